"""The ``kernelplan`` command: ``bench``, ``sparsify``, ``warmup``, ``cache info|clear`` and ``runtime-demo``."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kernelplan", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="check and time every op on this machine's device",
                           description="Check every op against an fp64 oracle and time it beside its torch "
                           "baseline. On CPU the shapes are small and the times are no speed claim.")
    bench.add_argument("suite", nargs="?", default="all",
                       help=f"which suite: all (default: {', '.join(BENCH_SUITES)}), or one of them, or "
                       f"{', '.join(BENCH_BY_NAME)} (by name only)")
    bench.add_argument("--device", default=None, help="cpu or cuda[:i]; default: cuda if present, else cpu")
    bench.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    bench.add_argument("--sweep", action="store_true",
                       help="sparse24 only, on a CUDA GPU: every shape of the sweep set (public model configs) at "
                       "every batch size, against dense; writes JSON (--json, default "
                       "sparse24-sweep-<gpu>[-f16].json here) and a PNG beside it, and prints a summary")
    bench.add_argument("--quick", action="store_true", help="with --sweep: 6 batch sizes instead of 12")
    bench.add_argument("--batch", type=int, nargs="+", default=None, metavar="N",
                       help="with --sweep: these batch sizes only, a part of a sweep too long for one run "
                       "(join the parts with --merge)")
    bench.add_argument("--merge", nargs="+", default=None, metavar="PART.json",
                       help="with --sweep: join the JSON of runs over disjoint --batch sizes (one GPU model, one "
                       "commit) into one sweep, its summary and PNG; needs no GPU")
    bench.add_argument("--dtype", default="bf16", choices=("bf16", "f16"), help="with --sweep: the weights' dtype")
    bench.add_argument("--l2", default="cold", choices=("cold", "warm"),
                       help="with --sweep: cold (default) rotates each call over copies of the weight past twice the "
                       "L2, as a model's forward reads it; warm times one weight over and over")
    bench.add_argument("--lm-heads", action="store_true",
                       help="with --sweep: the LM heads (vocab x hidden) of the sweep set's models instead of the "
                       "sweep set, shapes no kernel rule was fitted on; writes sparse24-sweep-lm-heads-<gpu>.json")
    bench.add_argument("--held-out", action="store_true",
                       help="with --sweep: the projections of public models outside the sweep set (Qwen2.5 0.5-3B, "
                       "Llama-3.2, Gemma-2-2B, Phi-2, GPT-2-XL, Mistral-Nemo), which no kernel rule was fitted on; "
                       "writes sparse24-sweep-held-out-models-<gpu>.json")
    bench.add_argument("--model", default=None, metavar="DIR",
                       help="with --sweep: the linear layers of a Hugging Face model directory instead (its 2:4 "
                       "layers, or those kp.sparsify would prune; read from the safetensors headers), timed without "
                       "bias; writes sparse24-sweep-given-<gpu>.json")
    bench.add_argument("--shapes", default=None, metavar="FILE",
                       help="with --sweep: the layers of a JSON file instead, [[M, K], ...] (out, in features); "
                       "writes sparse24-sweep-given-<gpu>.json")

    sparsify = sub.add_parser("sparsify", help="prune a checkpoint to 2:4 and write it compressed",
                              description="IN is a .safetensors file of dense weights (pruned by magnitude, written "
                              "as one compressed file), or a Hugging Face model directory (config.json and "
                              "model*.safetensors: the model is built with transformers, pruned by --method, and "
                              "written as a directory in --format).")
    sparsify.add_argument("input", nargs="?", help="a .safetensors file or a model directory (default: a built-in example)")
    sparsify.add_argument("output", nargs="?", help="where to write the compressed checkpoint")
    sparsify.add_argument("--method", default=None, choices=("magnitude", "wanda", "sparsegpt"),
                          help="directory input: the pruning method (default: sparsegpt with --calibration, else magnitude)")
    sparsify.add_argument("--calibration", default=None, metavar="FILE",
                          help="token ids (.npy, .pt or .safetensors): [N, S] windows, or a stream cut into "
                          "windows of --seq-len, at most 128")
    sparsify.add_argument("--eval", default=None, metavar="FILE", help="token ids to print dense and sparse perplexity on")
    sparsify.add_argument("--seq-len", type=int, default=2048, help="window length for a stream of token ids")
    sparsify.add_argument("--format", default="kernelplan", choices=("kernelplan", "sparse-24-bitmask", "dense"),
                          help="directory output: how the 2:4 layers are stored")
    sparsify.add_argument("--device", default=None, help="directory input: where to calibrate (default: cuda if present)")
    sparsify.add_argument("--filter", default=None, metavar="REGEX", help="prune only the 2-D weights whose name matches")
    sparsify.add_argument("--transposed", default="auto", metavar="auto|none|REGEX",
                          help="single file: the weights stored [in, out] (Hugging Face's Conv1D), pruned as the "
                               "linear layer's [out, in]; auto: GPT-2's, where the file holds wte and wpe")
    sparsify.add_argument("--experts", default="all", choices=("all", "auto", "none"),
                          help="directory input: a MoE model's experts (kp.sparsify's experts=). all (the default): "
                               "written 2:4, the model loaded whole by transformers; auto: only where they would run "
                               "faster on this machine; none: copied dense (without --calibration: shard by shard)")
    sparsify.add_argument("--dry-run", action="store_true", help="report what would change; write nothing")

    warm = sub.add_parser("warmup", help="compile a model's 2:4 kernels and settle their dispatch ahead of time",
                          description="For the 2:4 layers of a model directory (or of the given shapes) and batch "
                          "sizes: compile the kernels the dispatch rule names for every n up to the largest batch size "
                          "(kept in the kernel cache for later processes) and run each shape once at each batch size. "
                          "Prints shape, n, kernel, the speedup over dense the sweeps measured on this GPU, and the "
                          "configuration.")
    source = warm.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="DIR", help="a Hugging Face model directory: its 2:4 layers, read from the "
                        "safetensors headers (a dense checkpoint: the layers kp.sparsify would prune)")
    source.add_argument("--shapes", metavar="FILE", help='a JSON file: [[M, K], ...] (out, in features)')
    warm.add_argument("--batch-sizes", default="1,16,128,2048", help="comma-separated rows per call")
    warm.add_argument("--dtype", default=None, choices=("bf16", "f16"),
                      help="the weights' dtype (default: the checkpoint's for --model, else bf16)")
    warm.add_argument("--device", default=None, help="cuda[:i] (default: cuda if present, else cpu)")
    warm.add_argument("--sizes-only", action="store_true",
                      help="compile the batch sizes' kernels alone, not every n up to the largest")
    warm.add_argument("--tune", action="store_true",
                      help="tune each shape's tile (wgmma.sp, or mma.sp) at the batch sizes first "
                           "(kp.sparse24.tune_tiles) and store the choices in the plan cache, where a later "
                           "kp.warmup(model, sizes, tune=True) reads them without timing")

    cache = sub.add_parser("cache", help="inspect or clear the persistent plan and kernel caches")
    cache.add_argument("action", choices=("info", "clear"))
    cache.add_argument("--json", action="store_true", help="print info as JSON")
    cache.add_argument("--which", choices=("all", "plans", "kernels", "triton"), default="all",
                       help="the plan cache, the compiled cubins, kernelplan's Triton kernels, or all (default)")

    demo = sub.add_parser("runtime-demo", help="inject a fault into a stream of requests on the device runtime "
                          "and show the recovery, timed",
                          description="Runs SwiGLU forward requests through kernelplan.runtime on one device, kills "
                          "the worker halfway with a fault request, and reports when the requests in flight failed "
                          "(DeviceFault), when the restarted worker answered, and that old handles are refused "
                          "(StaleBuffer). Exit status 0 if it recovered.")
    demo.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    demo.add_argument("--fault", default="exit", choices=("exit", "kill", "sticky", "illegal_address"),
                      help="os._exit, SIGKILL, a sticky CUDA error reported, or (GPU) a kernel writing out of bounds")
    demo.add_argument("--requests", type=int, default=200, help="requests in the stream (at least 4)")
    demo.add_argument("--json", metavar="PATH", help="also write the timings and counts as JSON")

    args = parser.parse_args(argv)
    if args.command == "runtime-demo":
        return _runtime_demo(args)
    if args.command == "warmup":
        return _warmup(args)
    if args.command == "cache":
        return _cache(args)
    if args.command == "sparsify":
        return _sparsify(args)
    problem = _bench_args_problem(args)
    if problem:
        print(f"kernelplan bench: {problem}", file=sys.stderr)
        return 2
    if args.merge:
        from .bench import merge_sweep_command

        return merge_sweep_command(args.merge, args.json)
    if args.sweep:
        from .bench import run_sweep_command

        shapes, shapes_from, skipped = None, None, []
        if args.model or args.shapes:
            shapes_from = _layers_source(args)
            try:
                shapes, skipped = _sweep_shapes(args.model, args.shapes)
            except (OSError, ValueError) as e:
                print(f"kernelplan bench: {shapes_from}: {e}", file=sys.stderr)
                return 2
            for left in skipped:
                print(f"kernelplan bench: {shapes_from}: left out {left['m']}x{left['k']} ({', '.join(left['layers'])})"
                      f": {left['why']}", file=sys.stderr)
            if not shapes:
                print(f"kernelplan bench: {shapes_from}: no layer left to sweep", file=sys.stderr)
                return 2
        shape_set = ("given" if shapes else "lm heads" if args.lm_heads else "held-out models" if args.held_out
                     else "sweep set")
        return run_sweep_command(args.device, args.dtype, args.quick, args.json, args.l2, args.batch, shape_set,
                                 shapes, shapes_from, skipped)
    from .bench import run_bench

    return run_bench(args.suite, device=args.device, json_path=args.json)


def _runtime_demo(args) -> int:
    import torch

    if args.requests < 4:
        print(f"kernelplan runtime-demo: --requests {args.requests}: give at least 4 (half run before the fault)",
              file=sys.stderr)
        return 2
    device = "cuda:0" if args.device == "cuda" else args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"kernelplan runtime-demo: --device {args.device}: this machine has no CUDA device; use --device cpu",
              file=sys.stderr)
        return 2
    if args.fault == "illegal_address" and not device.startswith("cuda"):
        print("kernelplan runtime-demo: --fault illegal_address launches a CUDA kernel: give --device cuda, or "
              "another --fault on cpu", file=sys.stderr)
        return 2
    from .runtime.demo import run_demo

    out = run_demo(device, args.fault, args.requests)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if out["recovered"] else 1


BENCH_SUITES = ("sparse24", "gemm", "gated")  # what ``bench all`` runs (kernelplan.bench.run_bench)
BENCH_BY_NAME = ("llama", "accuracy")  # need transformers


def _bench_args_problem(args) -> str | None:
    """Why ``kernelplan bench`` cannot run with these arguments, found before any work starts; None if it can."""
    import os

    import torch

    if args.suite not in ("all", *BENCH_SUITES, *BENCH_BY_NAME):
        return f"unknown suite {args.suite!r}; choose all, {', '.join(BENCH_SUITES + BENCH_BY_NAME)}"
    if args.device is not None:
        try:
            dev = torch.device(args.device)
        except RuntimeError:
            return f"--device {args.device!r} is not a device; give cpu, cuda or cuda:INDEX"
        if dev.type not in ("cpu", "cuda"):
            return f"--device {args.device!r}: the bench runs on cpu or cuda"
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                return f"--device {args.device!r}: this machine has no CUDA device; leave --device out to run on cpu"
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                return (f"--device {args.device!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                        f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if (args.batch or args.merge) and not args.sweep:
        return "--batch and --merge belong to --sweep (kernelplan bench sparse24 --sweep --batch 2048 8192)"
    chosen = [flag for flag, on in (("--lm-heads", args.lm_heads), ("--held-out", args.held_out),
                                    ("--model", args.model), ("--shapes", args.shapes)) if on]
    if args.merge:
        if (args.batch or args.quick or args.device is not None or args.dtype != "bf16" or args.l2 != "cold"
                or chosen):
            return ("--merge joins finished parts: it takes their dtype, L2 mode, shapes and device from the files; "
                    "leave out --batch, --quick, --device, --dtype, --l2, --lm-heads, --held-out, --model and "
                    "--shapes")
    elif args.batch:
        bad = [n for n in args.batch if n < 1]
        if bad:
            return f"--batch {bad[0]}: a batch size is 1 or more"
        if args.quick:
            return "--batch and --quick both choose the batch sizes: give one of them"
    if len(chosen) > 1:
        return f"{' and '.join(chosen)} each choose the shapes: give one of them"
    if args.sweep:
        if args.suite != "sparse24":
            return f"--sweep times the 2:4 kernels: give the suite sparse24 (kernelplan bench sparse24 --sweep), not {args.suite!r}"
        no_gpu = not torch.cuda.is_available() or args.device is not None and torch.device(args.device).type != "cuda"
        if no_gpu and not args.merge:  # --merge joins files: it needs no device
            return ("--sweep times the 2:4 GPU kernels against dense on a CUDA device, and this run has none; "
                    "leave --sweep out for the CPU checks of every op")
    elif args.quick or args.dtype != "bf16" or args.l2 != "cold" or chosen:
        return ("--quick, --dtype, --l2, --lm-heads, --held-out, --model and --shapes belong to --sweep (kernelplan "
                "bench sparse24 --sweep --quick --dtype f16)")
    if args.json is not None:
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder):
            return f"--json {args.json}: the folder {folder} does not exist; create it or give another path"
        if not os.access(folder, os.W_OK):
            return f"--json {args.json}: the folder {folder} is not writable"
    return None


def _sparsify(args) -> int:
    import os
    import tempfile

    from .stream import sparsify_file
    from .errors import InvalidProblem, KernelPlanError

    if (args.input is None) != (args.output is None):
        print("kernelplan sparsify: give both IN.safetensors and OUT.safetensors, or neither for the example",
              file=sys.stderr)
        return 2
    if args.input is not None and os.path.isdir(args.input):
        if args.transposed != "auto":
            print("kernelplan sparsify: --transposed is for a single file; a model directory's Conv1D layers are "
                  "found from the model itself", file=sys.stderr)
            return 2
        try:
            return _sparsify_directory(args)
        except KernelPlanError as e:
            print(f"kernelplan sparsify: {e}", file=sys.stderr)
            return 2
    if args.method not in (None, "magnitude") or args.calibration or args.eval:
        print("kernelplan sparsify: --method, --calibration and --eval need a model: pass a Hugging Face model "
              "directory (config.json and model*.safetensors) as IN", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        source, target = args.input, args.output
        if source is None:
            source, target = _example_checkpoint(tmp), os.path.join(tmp, "example-2of4.safetensors")
            print(f"no checkpoint given: sparsifying a built-in example model ({source})")
        try:
            if args.output is not None and os.path.exists(target) and os.path.exists(source) and \
                    os.path.samefile(source, target):
                raise InvalidProblem(f"OUT {target} is IN {source}: sparsify would overwrite the dense original; "
                                     f"give another output path")
            # Tensor by tensor: memory holds a layer at a time, not the file (kernelplan/stream.py).
            report = sparsify_file(source, target, args.filter, dry_run=args.dry_run, transposed=args.transposed)
            print(report.summary())
            if not args.dry_run:
                print(f"wrote {target}")
        except KernelPlanError as e:
            print(f"kernelplan sparsify: {e}", file=sys.stderr)
            return 2
    return 0


def _token_ids(path: str):
    """Token ids from .npy, .pt or .safetensors (its first tensor), as int64."""
    import os

    import torch

    from .errors import InvalidProblem

    if not os.path.isfile(path):
        raise InvalidProblem(f"{path} does not exist or is not a file: pass a file of token ids")
    try:
        if path.endswith(".npy"):
            import numpy as np

            ids = torch.from_numpy(np.load(path))
        elif path.endswith(".safetensors"):
            from safetensors.torch import load_file

            ids = next(iter(load_file(path).values()))
        else:
            ids = torch.load(path, weights_only=True)
    except Exception as e:  # any reader's failure is the same problem for the user: the file is not token ids
        raise InvalidProblem(f"{path} could not be read as token ids ({e}); write them with numpy.save or "
                             f"torch.save") from e
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() not in (1, 2):
        raise InvalidProblem(f"{path} holds {getattr(ids, 'dtype', type(ids).__name__)} of shape "
                             f"{tuple(getattr(ids, 'shape', ()))}; token ids are integers, [T] or [N, S]")
    return ids.long()


def _sparsify_directory(args) -> int:
    import os
    import re

    import torch

    import kernelplan as kp

    from . import hf
    from .errors import InvalidProblem

    if args.output is None:
        raise InvalidProblem("give OUT, the directory to write the sparsified model to")
    if os.path.exists(args.output) and os.path.samefile(args.input, args.output):
        raise InvalidProblem(f"OUT {args.output} is IN: sparsify would overwrite the dense original")
    regex = re.compile(args.filter) if args.filter else None
    keep = (lambda name, layer: regex.search(name) is not None) if regex else None
    streaming = not args.calibration and not args.eval and args.method in (None, "magnitude")
    experts = hf.experts_modules(args.input) if streaming and args.experts != "none" else []
    if experts:
        # On disk the experts are per expert; transformers stacks them as it loads, which the streaming path cannot.
        print(f"{len(experts)} MoE experts modules ({experts[0]} ...): the model is loaded whole, by transformers, "
              f"so that its experts are pruned and written 2:4 too (--experts none keeps the shard-by-shard path, "
              f"the experts copied dense)")
        streaming = False
    if streaming:
        # Nothing needs the model in memory: shard by shard, a tensor at a time.
        report = hf.sparsify_directory(args.input, args.output, args.format, keep, dry_run=args.dry_run)
        print(report.summary())
        if not args.dry_run:
            print(f"wrote {args.output} ({args.format}), shard by shard")
            print(_load_hint(args.format))
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = hf.load_for_pruning(args.input, device)
    calibration = None
    if args.calibration:
        ids = _token_ids(args.calibration)
        if ids.dim() == 1:
            usable = ids.numel() // args.seq_len * args.seq_len
            if not usable:
                raise InvalidProblem(f"{args.calibration} holds {ids.numel()} tokens, fewer than one window of "
                                     f"--seq-len {args.seq_len}")
            ids = ids[:usable].view(-1, args.seq_len)
        calibration = ids[:128]
    held = _token_ids(args.eval) if args.eval else None
    if held is not None:
        print(f"dense perplexity: {kp.evaluate(model, held, seq_len=args.seq_len):.4f}")
    report = kp.sparsify(model, method=args.method, calibration=calibration, report=calibration is not None,
                         filter_fn=keep, experts=args.experts)
    print(report.summary())
    if held is not None:
        print(f"sparse perplexity ({report.method}): {kp.evaluate(model, held, seq_len=args.seq_len):.4f}")
    if not args.dry_run:
        files = hf.save_model(model, args.output, args.format)
        print(f"wrote {args.output}: {', '.join(files)} ({args.format})")
        print(_load_hint(args.format))
    return 0


def _load_hint(fmt: str) -> str:
    """How to load what ``kernelplan sparsify`` wrote into a model directory."""
    if fmt != "kernelplan":
        return ("load it with kp.hf.load_model(DIR); transformers reads the pruned weights of format dense, and "
                "compressed-tensors reads sparse-24-bitmask")
    return ("load it with kp.hf.load_model(DIR), or with transformers (AutoModelForCausalLM, or the class config.json "
            "names) from_pretrained(DIR) once kp.hf.register_quantizer() has run in the process")


def _example_checkpoint(directory: str) -> str:
    """A small MLP's dense weights, one layer of which cannot be 2:4 (in_features=60)."""
    import os

    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 60), torch.nn.Linear(60, 8)
    )
    path = os.path.join(directory, "example.safetensors")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return path


def _warmup(args) -> int:
    import torch

    from .dtypes import dtype_info
    from .errors import KernelPlanError
    from .nn import Sparse24Linear
    from .warm import table, warmup

    try:
        sizes = [int(v) for v in args.batch_sizes.split(",")]
    except ValueError as e:
        print(f"kernelplan warmup: --batch-sizes {args.batch_sizes}: {e}; give numbers of rows, such as 1,16,128",
              file=sys.stderr)
        return 2
    try:
        layers, which = _warmup_layers(args)
    except (OSError, ValueError, KernelPlanError) as e:
        print(f"kernelplan warmup: {_layers_source(args)}: {e}", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        # Random 2:4 weights of each shape: kernels and dispatch depend on the shape, not the values.
        model = torch.nn.ModuleList(
            Sparse24Linear.from_dense(torch.nn.Linear(k, m, bias=bias, device=device,
                                                      dtype=dtype_info(args.dtype).dtype if args.dtype else dtype))
            for m, k, bias, dtype in layers)
        rows = warmup(model, sizes, progress=sys.stderr.isatty(), every_n=not args.sizes_only, tune=args.tune)
    except (KernelPlanError, RuntimeError) as e:
        print(f"kernelplan warmup: {e}", file=sys.stderr)
        return 2
    if which:
        print(which)
    print(table(rows))
    if rows:
        print(f"{rows[0]['compiled']} kernels compiled or read from the cache in {rows[0]['compile_s']:.1f} s")
    return 0


def _layers_source(args) -> str:
    """Where ``--model`` or ``--shapes`` takes the layers from, as the user gave it."""
    return f"--model {args.model}" if args.model else f"--shapes {args.shapes}"


def _given_layers(model: str | None, shapes: str | None) -> tuple[list[dict], str]:
    """The layers of a model directory (``--model``) or a JSON file of shapes (``--shapes``), each ``{"name", "m",
    "k", "bias", "dtype"}`` as ``hf.layer_shapes`` gives them, and a word saying which they are: ``"2:4"``, ``"would
    prune"`` or ``"given"``."""
    import torch

    if shapes:
        with open(shapes) as f:
            pairs = json.load(f)
        if not isinstance(pairs, list) or not all(isinstance(s, list) and len(s) == 2 and
                                                  all(isinstance(v, int) and v > 0 for v in s) for s in pairs):
            raise ValueError("it must be a JSON list of [M, K] pairs of positive integers")
        return [{"name": f"{m}x{k}", "m": m, "k": k, "bias": False, "dtype": torch.bfloat16}
                for m, k in dict.fromkeys(map(tuple, pairs))], "given"
    from .hf import layer_shapes

    which, found = layer_shapes(model)
    if not found:
        raise ValueError("it holds no 2:4 layer and no 2-D weight kp.sparsify would prune")
    return found, which


def _sweep_shapes(model: str | None, shapes: str | None) -> tuple[dict[tuple[int, int], list[str]], list[dict]]:
    """``--sweep --model`` or ``--shapes``: each distinct (M, K) with the layers that have it, as the sweep set's
    (``bench.shapes.sweep_shapes``), and the layers left out, each ``{"layers", "m", "k", "why"}``: those the 2:4
    format cannot hold (K not a multiple of 8; kp.sparsify leaves them dense)."""
    from .sparse24.format import COMPRESS_K

    out: dict[tuple[int, int], list[str]] = {}
    for layer in _given_layers(model, shapes)[0]:
        out.setdefault((layer["m"], layer["k"]), []).append(layer["name"])
    swept, skipped = {}, []
    for (m, k), names in out.items():
        if k % COMPRESS_K == 0:
            swept[m, k] = names
        else:
            skipped.append({"layers": names, "m": m, "k": k,
                            "why": f"K = {k} is not a multiple of {COMPRESS_K}, the 2:4 format's: the layer stays dense"})
    return swept, skipped


def _warmup_layers(args) -> tuple[list[tuple], str]:
    """Distinct ``(M, K, bias, dtype)`` to warm up, and a line saying where they came from (--model)."""
    import torch

    found, which = _given_layers(args.model, args.shapes)
    layers = list(dict.fromkeys((f["m"], f["k"], f["bias"], f["dtype"]) for f in found))
    if which == "given":
        return layers, ""
    floating = (torch.bfloat16, torch.float16, torch.float32)
    odd = [f for f in found if f["dtype"] not in floating]
    if odd and args.dtype is None:
        raise ValueError(f"{odd[0]['name']} is stored as {odd[0]['dtype']}; give --dtype bf16 or f16")
    what = "2:4 layers" if which == "2:4" else "layers kp.sparsify would prune (a dense checkpoint)"
    return layers, f"{args.model}: {len(found)} {what}, {len(layers)} distinct shapes"


def _cache(args) -> int:
    from .cache import plan_cache

    from .kernels.kernel_cache import kernel_cache
    from .kernels.triton_cache import triton_cache

    caches = {"plans": plan_cache(), "kernels": kernel_cache(), "triton": triton_cache()}
    chosen = list(caches) if args.which == "all" else [args.which]
    if args.action == "clear":
        for name in chosen:
            n = caches[name].clear()
            print(f"cleared {n} entries from the {name} cache")
        return 0
    infos = {name: caches[name].info() for name in chosen}
    if args.json:
        print(json.dumps(infos[chosen[0]] if len(chosen) == 1 else infos))
        return 0
    for name, info in infos.items():
        print(f"{name}:")
        print(f"  path:      {info['path']}" + (" (read-only)" if info.get("read_only") else ""))
        limit = f"max {info['max_entries']} entries" if "max_entries" in info else f"max {info['max_bytes'] / 2**20:.0f} MiB"
        print(f"  entries:   {info['entries']} ({limit})")
        print(f"  size:      {info['size_bytes'] / 1024:.1f} KiB")
        if info["unusable"]:
            print(f"  unusable:  {info['unusable']} (this process keeps results in memory)")
        if info.get("overridden_by"):
            print(f"  unused:    TRITON_CACHE_DIR is set, so Triton caches in {info['overridden_by']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
