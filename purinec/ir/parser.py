"""Being written."""


def parse(*args, **kwargs):
    raise NotImplementedError("parser is being written")
