"""The `purinec` command."""

from __future__ import annotations

import argparse
import os
import sys
import time

from purinec.errors import PurinecError

STAGE_HELP = """\
stages, in pipeline order (autodiff and optimizer only with --train):
  lower         the graph as the front end built it (a .pir file: as parsed)
  infer_shapes  every output type recomputed from its inputs
  verify        every IR invariant checked (the graph is unchanged)
  autodiff      the backward graph appended: grad.<param> outputs
  optimizer     SGD's updates appended: new params and momentum histories
  dce           nodes that reach no output removed
  cse           identical nodes merged (the final IR)
"""

MODEL_HELP = ("a zoo name (mlp, lenet, cifar_quick, nin, inception), a Python file "
              "defining build(batch), or a .pir IR file")


def _add_solver_args(p: argparse.ArgumentParser, lr: float) -> None:
    p.add_argument("--lr", type=float, default=lr, help=f"learning rate (default {lr})")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    p.add_argument("--weight-decay", type=float, default=5e-4,
                   help="L2 weight decay (default 5e-4)")


def _sgd(args):
    from purinec.passes.optimizer import SGD

    return SGD(lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)


def cmd_dump(args) -> int:
    from purinec.compiler import STAGES, build_graph, load_source
    from purinec.fileio import atomic_write_text

    wanted = STAGES if args.stage == "all" else (args.stage or STAGES[-1],)
    unknown = [s for s in wanted if s not in STAGES]
    if unknown:
        raise PurinecError(f"unknown stage {unknown[0]!r}; stages: {', '.join(STAGES)}")
    if args.output:
        os.makedirs(args.output, exist_ok=True)
    written = []

    def show(stage, graph):
        if stage not in wanted:
            return
        text = str(graph)
        if args.output:
            path = os.path.join(args.output,
                                f"{graph.name}.{STAGES.index(stage):02d}-{stage}.pir")
            atomic_write_text(path, text)
            written.append(path)
        else:
            if len(wanted) > 1:
                print(f"// ---- after {stage} ----")
            print(text)

    train = _sgd(args) if args.train else None
    build_graph(load_source(args.model, args.batch), train, show)
    for path in written:
        print(f"wrote {path}")
    if not args.train and any(s in ("autodiff", "optimizer") for s in wanted) and \
            args.stage != "all":
        print(f"note: stage {args.stage} runs only with --train", file=sys.stderr)
    return 0


def cmd_train(args) -> int:
    from purinec.compiler import compile
    from purinec.data import load_dataset
    from purinec.train import train

    data = load_dataset(args.data, seed=args.seed)
    print(data)
    start = time.perf_counter()
    model_kwargs = {}
    if not args.model.endswith(".pir"):
        model_kwargs = {"input_shape": data.input_shape, "num_classes": data.num_classes}
    program = compile(args.model, target=args.target, train=_sgd(args), batch=args.batch,
                      seed=args.seed, **model_kwargs)
    batch = program.ir.input("data").type.shape[0]
    print(f"compiled {program.ir.name} for target {program.target} in "
          f"{time.perf_counter() - start:.2f} s ({len(program.ir.nodes)} nodes, "
          f"{sum(p.size for p in program.params.values())} parameters)")
    start = time.perf_counter()
    result = train(program, data, args.epochs, batch, seed=args.seed,
                   progress=not args.quiet and sys.stderr.isatty() or args.progress)
    for e in result.epochs:
        print(f"epoch {e.epoch:3d}  loss {e.loss:.4f}  train accuracy {e.train_accuracy:.4f}"
              f"  test accuracy {e.test_accuracy:.4f}")
    print(f"trained {args.epochs} epoch(s) in {time.perf_counter() - start:.1f} s: "
          f"test accuracy {result.final.test_accuracy:.4f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="purinec",
        description="A Purine-style bi-graph compiler for deep networks: lower a model to "
                    "typed IR, derive its backward graph and solver, and run or train it.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    dump = sub.add_parser("dump", help="print or write the IR at any pipeline stage",
                          description="Print the IR of MODEL after a pipeline stage, or write "
                                      "one .pir file per stage with -o.",
                          epilog=STAGE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    dump.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    dump.add_argument("--train", action="store_true",
                      help="compile the training iteration (backward and SGD)")
    dump.add_argument("--batch", type=int, help="batch size (default: the model's)")
    dump.add_argument("--stage", metavar="NAME|all",
                      help="stage to show (default: the final IR); 'all' shows every stage")
    dump.add_argument("-o", "--output", metavar="DIR",
                      help="write one file per stage into DIR and print their paths")
    _add_solver_args(dump, 0.01)
    dump.set_defaults(func=cmd_dump)

    tr = sub.add_parser("train", help="train a model on a data set",
                        description="Compile MODEL's training iteration and train it, "
                                    "reporting loss and test accuracy every epoch.")
    tr.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    tr.add_argument("--target", default="reference",
                    help="code generation target (default: reference, NumPy)")
    tr.add_argument("--data", default="digits",
                    help="data set: digits (scikit-learn's 8x8 digits) or synthetic "
                         "(default: digits)")
    tr.add_argument("--epochs", type=int, default=10, help="passes over the data (default 10)")
    tr.add_argument("--batch", type=int, help="batch size (default: the model's)")
    tr.add_argument("--seed", type=int, default=0,
                    help="seed of the data split, shuffling and initial weights (default 0)")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    tr.add_argument("--progress", action="store_true",
                    help="show the progress bar even when stderr is not a terminal")
    _add_solver_args(tr, 0.05)
    tr.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PurinecError as err:
        print(f"purinec: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("purinec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
