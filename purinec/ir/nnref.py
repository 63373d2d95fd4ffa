"""NumPy references of the convolution, pooling, LRN and dropout ops (being written)."""


def _unwritten(*args, **kwargs):
    raise NotImplementedError("nnref is being written")


conv2d = conv2d_grad_input = conv2d_grad_weight = _unwritten
max_pool2d = max_pool2d_grad = avg_pool2d = avg_pool2d_grad = _unwritten
lrn = lrn_grad = dropout_mask = _unwritten
