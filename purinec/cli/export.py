"""`purinec export`: a model's inference graph and weights written as an ONNX file."""

from __future__ import annotations

from purinec.cli.common import (MODEL_HELP, HelpFormatter, add_model_args, check_writable,
                                is_artifact, model_kwargs, positive, seed_value)
from purinec.errors import PurinecError, refuse_options
from purinec.onnxio import OPSET

EXPORT_HELP = f"""\
examples:
  purinec export lenet -o lenet.onnx --batch 1     freshly initialized weights (seed 0)
  purinec export ck.purine -o trained.onnx         a checkpoint's trained weights
  purinec export mynet.py -o mynet.onnx --seed 3

The file is ONNX opset {OPSET}: data inputs and outputs keep their names, the batch is
fixed (--batch), and the parameters are initializers under their own names. A graph
with ops ONNX cannot spell (a .pir training iteration's loss and updates) is refused,
naming the node, and so is a program compiled over several devices.
"""


def add_parser(subparsers) -> None:
    exp = subparsers.add_parser(
        "export", help="write a model's inference graph and weights as an ONNX file",
        description="Write the inference graph of MODEL, with the weights it starts from "
                    "(those purinec.compile(MODEL, seed=SEED) draws), or of a .purine "
                    "artifact or checkpoint, with its trained weights, as one ONNX file "
                    "that onnxruntime and other ONNX tools run.",
        epilog=EXPORT_HELP, formatter_class=HelpFormatter)
    exp.add_argument("model", metavar="MODEL|FILE.purine",
                     help=f"{MODEL_HELP}; or an .onnx file; or an artifact from `purinec "
                          f"compile` or a checkpoint from `purinec train` (its weights)")
    exp.add_argument("-o", "--output", metavar="FILE.onnx", required=True,
                     help="the ONNX file to write (atomically: a failed write leaves an "
                          "existing file as it was)")
    exp.add_argument("--batch", type=positive,
                     help="batch size, fixed in the file (default: the model's; an "
                          "artifact's is fixed)")
    exp.add_argument("--seed", type=seed_value,
                     help="seed of MODEL's initial weights (default 0; an artifact has its "
                          "own weights)")
    add_model_args(exp)
    exp.set_defaults(func=cmd_export, parser=exp)


def cmd_export(args) -> int:
    from purinec.compiler import compile, load

    if not args.output.endswith(".onnx"):
        raise PurinecError(f"-o {args.output}: name the file FILE.onnx (compile and run "
                           f"recognize ONNX files by that suffix)")
    check_writable(args, ("output",))
    if is_artifact(args.model):
        refuse_options(vars(args), ("batch", "seed", "input_shape", "num_classes"),
                       f"{args.model} has its own shapes and weights")
        program = load(args.model, "reference")
    else:
        program = compile(args.model, target="reference", batch=args.batch,
                          seed=args.seed or 0, **model_kwargs(args))
    try:
        print(program.export_onnx(args.output))
    finally:
        program.close()
    return 0
