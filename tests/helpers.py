"""Comparison helpers: fp64 oracles and per-dtype tolerance tables."""

from __future__ import annotations

import pytest
import torch

# Floors added to "2 x the same-dtype torch error", relative to max |oracle|.
# Forward and backward are kept apart: backward chains more roundings.
FWD_ATOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
BWD_ATOL = {torch.float64: 1e-11, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rel_err(out: torch.Tensor, oracle: torch.Tensor) -> float:
    if oracle.numel() == 0:
        return 0.0
    scale = oracle.detach().double().abs().max().clamp_min(1e-30)
    return float((out.detach().double() - oracle.detach().double()).abs().max() / scale)


def assert_close(out, oracle, baseline, *, atol: float, what: str = "output") -> None:
    """``out`` within 2x the error of the same-dtype torch ``baseline`` + ``atol`` (flash-attn's bar)."""
    assert out.shape == oracle.shape, f"{what}: shape {tuple(out.shape)} != {tuple(oracle.shape)}"
    assert out.dtype == baseline.dtype, f"{what}: dtype {out.dtype} != {baseline.dtype}"
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err, base = rel_err(out, oracle), rel_err(baseline, oracle)
    assert err <= 2 * base + atol, f"{what}: rel err {err:.3e} > 2 x torch's {base:.3e} + {atol:.1e}"


def poisoned(shape, dtype, device="cpu") -> torch.Tensor:
    """An output buffer full of NaN (True for bool), to prove every element gets written."""
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.full(shape, float("nan"), dtype=torch.float32, device=device).to(dtype)


# Skips a test off Hopper: the wgmma.sp kernels are sm_90a code.
sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                          reason="needs an sm_90 (Hopper) GPU")


class StubDriver:
    """cuLaunchKernel that records each launch: its grid, block, shared bytes, stream and each parameter slot's
    bytes (``sizes``: the parameters' byte sizes), and in ``addresses`` where its parameter pointers were."""

    def __init__(self, sizes, error=0):
        self.sizes, self.error, self.launches, self.addresses = sizes, error, [], []

    def CUstream(self, raw):  # noqa: N802 (cuda-bindings' name)
        return ("stream", raw)

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):  # noqa: N802
        import ctypes

        self.addresses.append(params)
        slots = (ctypes.c_void_p * len(self.sizes)).from_address(params)
        self.launches.append(((gx, gy, gz), bx, shared, stream,
                              [ctypes.string_at(slots[i], size) for i, size in enumerate(self.sizes)]))
        return (self.error,)

    # cuLaunchKernelEx and its structures, as cuda-bindings names them: each launch recorded as cuLaunchKernel's,
    # and its attributes' (id, value) pairs in ``attributes``.
    class CUlaunchConfig:  # noqa: N801
        pass

    class CUlaunchAttribute:  # noqa: N801
        def __init__(self):
            import types

            self.id, self.value = None, types.SimpleNamespace()

    class CUlaunchAttributeID:  # noqa: N801
        CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6

    def cuLaunchKernelEx(self, config, fn, params, extra):  # noqa: N802
        self.attributes = [(a.id, vars(a.value)) for a in config.attrs[:config.numAttrs]]
        return self.cuLaunchKernel(fn, config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX,
                                   config.blockDimY, config.blockDimZ, config.sharedMemBytes, config.hStream, params,
                                   extra)


def stub_driver(monkeypatch, types, error=0) -> StubDriver:
    """``kernels.direct`` launching into a ``StubDriver`` for parameters of Triton types ``types``."""
    from kernelplan.kernels import direct

    stub = StubDriver([direct._SIZE.get(t, 8) for t in types], error)
    monkeypatch.setattr(direct, "_driver", lambda: stub)
    monkeypatch.setattr(direct, "_STREAMS", {})  # the stub's streams never reach a real launch's cache
    return stub


def kernelplan_cli(*args, env: dict | None = None):
    """``kernelplan ARGS`` run in this process: ``kernelplan.cli.main``, which ``python -m kernelplan`` and the
    installed script call, with ``env`` set for the call.  Returns a ``CompletedProcess`` as ``subprocess.run`` would:
    the exit status (argparse's included), stdout, and stderr with each warning the call raised printed as a fresh
    process prints it (once per place it is raised).  A fresh interpreter per command cost about 3 s of importing
    torch, 14 commands of the suite's slowest tests; ``test_nn_and_cli.py`` starts the real command."""
    import contextlib
    import io
    import os
    import subprocess
    import warnings
    from unittest import mock

    from kernelplan import cli

    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, env or {}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # a new filter resets the registries: each warning shows, once a place
        try:
            code = cli.main([str(a) for a in args])
        except SystemExit as e:  # argparse's usage errors (2) and --help (0)
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    for w in caught:
        err.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line))
    return subprocess.CompletedProcess(["kernelplan", *map(str, args)], code, out.getvalue(), err.getvalue())


def in_processes(target, arguments: list[tuple], timeout: float = 300) -> list[int]:
    """``target(*args)`` for each of ``arguments``, each in a process of its own, all started before any is waited
    for; their exit codes.  Forked, so a child starts with this process's imports (a fresh interpreter spent about 3 s
    importing torch) and the writers meet at once.  The children must not use CUDA: a forked CUDA context is unusable."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    procs = [context.Process(target=target, args=args) for args in arguments]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.exitcode is None:
            p.kill()
    return [p.exitcode for p in procs]


def recording_backend() -> tuple:
    """``(backend, graphs)``: a torch.compile backend that runs each FX graph as dynamo traced it, and the list it
    appends each graph to, as text."""
    graphs = []

    def backend(gm, inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    return backend, graphs


def compiled_graphs(module, *args, **kwargs):
    """``(output, graphs)`` of ``torch.compile(module, fullgraph=True)(*args, **kwargs)``: the FX graphs dynamo traced,
    as text (``recording_backend``)."""
    backend, graphs = recording_backend()
    return torch.compile(module, fullgraph=True, backend=backend)(*args, **kwargs), graphs


def compiles_after_warmup(model, batch_sizes=(4, 64, 200), vocab: int = 100) -> int:
    """NVRTC compiles that a model's calls at ``batch_sizes`` tokens made after ``kp.warmup`` at those sizes, on the
    GPU, in inference mode (the callers point KERNELPLAN_CACHE_DIR at an empty folder: a cold disk cache)."""
    import kernelplan as kp
    from kernelplan.kernels import nvrtc

    with torch.inference_mode():
        kp.warmup(model, batch_sizes=batch_sizes, progress=False)
        compiles = nvrtc.COMPILES[0]
        for n in batch_sizes:
            model(torch.randint(0, vocab, (1, n), device="cuda"))
    return nvrtc.COMPILES[0] - compiles
