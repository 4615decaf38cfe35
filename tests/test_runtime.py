"""The supervised device runtime (kernelplan.runtime) on CPU workers: every request type against the same plan run
in this process, stale handles, faults by os._exit / SIGKILL / a reported sticky CUDA error, restart intensity, and
1,000 requests with 5 faults.  The GPU drill (a real illegal-address kernel) is ``test_gpu_illegal_address``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib.util
import os
import random
import signal
import time

import pytest
import torch

from kernelplan.dtypes import dtype_info
from kernelplan.errors import InvalidProblem
from kernelplan.gated import (GatedActivationArgs, GatedActivationBackwardArgs, GatedActivationBackwardPlan,
                              GatedActivationDescriptor, GatedActivationPlan)
from kernelplan.gemm import GemmArgs, GemmDescriptor, GemmPlan, ScaleSet
from kernelplan.runtime import (Buffer, DeviceFailed, DeviceFault, FaultRequest, Fp8LinearRequest,
                                GatedBackwardRequest, GatedForwardRequest, GemmRequest, Runtime, Sparse24LinearRequest,
                                StaleBuffer)
from kernelplan.sparse24 import compress, prune
from kernelplan.sparse24.gemm import GemmSparse24Args, GemmSparse24Descriptor, GemmSparse24Plan


# The Ray backend runs the same tests where Ray is installed (the ray extra; CI's test extra does not have it).
BACKENDS = ["local"] + (["ray"] if importlib.util.find_spec("ray") is not None else [])
# What a dead worker's DeviceFault names, by backend and fault: a local process's exit status; Ray's actor death.
CAUSES = {"local": {"exit": "exited with code 3", "kill": "killed by signal 9", "sticky": "sticky CUDA error"},
          "ray": {"exit": "Ray actor died", "kill": "Ray actor died", "sticky": "sticky CUDA error"}}


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    if request.param == "ray":
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield "ray"
        ray.shutdown()
    else:
        yield "local"


@pytest.fixture(scope="module")
def rt(backend):
    with Runtime(devices=("cpu",), backend=backend) as runtime:
        yield runtime


def _gated(shape=(5, 3, 12), kind="swiglu"):
    desc = GatedActivationDescriptor(kind, shape, len(shape) - 1, "f32")
    return desc, torch.randn(shape)


def _same(backend: str, got, want) -> bool:
    """A local worker runs the plan as this process does: bit for bit.  A Ray actor runs with Ray's thread count
    (OMP_NUM_THREADS=1), so the CPU kernels sum in another order: equal to float32 rounding."""
    if backend == "local":
        return torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-5)
    return True


def test_every_request_type_matches_the_plan_run_here(rt, backend):
    b = rt.blocking
    same = functools.partial(_same, backend)
    # gated forward and backward (3-D, odd sizes)
    desc, x = _gated()
    y_here = torch.empty(desc.output_shape())
    GatedActivationPlan.select(desc).run(GatedActivationArgs(x, y_here))
    xb, yb = b.upload(x), b.upload(torch.zeros(desc.output_shape()))
    reply = b.run(GatedForwardRequest(desc, GatedActivationArgs(xb, yb)))
    assert same(b.download(yb), y_here) and reply.outputs == (yb,) and reply.kernel_ms >= 0
    assert reply.sku.op and reply.sku.backend
    dy = torch.randn(desc.output_shape())
    dx_here = torch.empty(desc.input_shape)
    GatedActivationBackwardPlan.select(desc).run(GatedActivationBackwardArgs(dy, x, dx_here))
    dxb = b.upload(torch.zeros(desc.input_shape))
    b.run(GatedBackwardRequest(desc, GatedActivationBackwardArgs(b.upload(dy), xb, dxb)))
    assert same(b.download(dxb), dx_here)

    # GEMM with bias and relu, alpha and beta with C
    m, n, k = 7, 9, 13
    a, w, c, bias = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n), torch.randn(n)
    gdesc = GemmDescriptor(m=m, n=n, k=k, dtype="f32", epilogue="relu_bias", transb=True, has_c=True)
    d_here = torch.empty(m, n)
    GemmPlan.select(gdesc).run(GemmArgs(a, w, d_here, c=c, bias=bias, alpha=0.5, beta=2.0))
    db = b.upload(torch.zeros(m, n))
    args = GemmArgs(b.upload(a), b.upload(w), db, c=b.upload(c), bias=b.upload(bias), alpha=0.5, beta=2.0)
    assert b.run(GemmRequest(gdesc, args)).outputs == (db,)
    assert same(b.download(db), d_here)

    # fp8 linear: e4m3 operands, tensor-wise scales, bf16 out
    f8 = torch.float8_e4m3fn
    a8, w8 = (torch.randn(m * 2, 32) / 2).to(f8), (torch.randn(16, 32) / 2).to(f8)
    sa, sb = torch.tensor([0.5]), torch.tensor([2.0])
    fdesc = GemmDescriptor(m=m * 2, n=16, k=32, dtype=dtype_info(f8).name, out_dtype="bf16", transb=True,
                           scale_a="tensor", scale_b="tensor")
    d8_here = torch.empty(m * 2, 16, dtype=torch.bfloat16)
    GemmPlan.select(fdesc).run(GemmArgs(a8, w8, d8_here, scales=ScaleSet(a=sa, b=sb)))
    d8 = b.upload(torch.zeros(m * 2, 16, dtype=torch.bfloat16))
    b.run(Fp8LinearRequest(fdesc, GemmArgs(b.upload(a8), b.upload(w8), d8,
                                           scales=ScaleSet(a=b.upload(sa), b=b.upload(sb)))))
    assert same(b.download(d8), d8_here)

    # 2:4 linear
    w24 = compress(prune(torch.randn(24, 64)))
    xs = torch.randn(5, 64)
    sdesc = GemmSparse24Descriptor(n=5, m=24, k=64, dtype="f32")
    y24_here = torch.empty(5, 24)
    GemmSparse24Plan.select(sdesc).run(GemmSparse24Args(xs, w24.values, w24.metadata, y24_here))
    y24 = b.upload(torch.zeros(5, 24))
    b.run(Sparse24LinearRequest(sdesc, GemmSparse24Args(b.upload(xs), b.upload(w24.values), b.upload(w24.metadata),
                                                        y24)))
    assert same(b.download(y24), y24_here)


def test_a_prepared_request_runs_again_and_refuses_freed_buffers(rt):
    b = rt.blocking
    desc, x = _gated((6, 10))
    xb, yb = b.upload(x), b.upload(torch.zeros(6, 5))
    prepared = b.prepare(GatedForwardRequest(desc, GatedActivationArgs(xb, yb)))
    want = torch.empty(6, 5)
    GatedActivationPlan.select(desc).run(GatedActivationArgs(x, want))
    for _ in range(3):
        assert b.run(prepared).outputs == (yb,)
    assert torch.equal(b.download(yb), want)
    b.free(xb)
    with pytest.raises(StaleBuffer):
        b.run(prepared)
    bad = b.upload(torch.zeros(6, 4))  # checked once, when prepared
    with pytest.raises(InvalidProblem):
        b.prepare(GatedForwardRequest(desc, GatedActivationArgs(b.upload(x), bad)))


def test_uploads_are_snapshots_and_downloads_too(rt):
    t = torch.arange(6.0)
    buf = rt.blocking.upload(t[::2])  # non-contiguous in, a copy held
    t.zero_()
    got = rt.blocking.download(buf)
    assert torch.equal(got, torch.tensor([0.0, 2.0, 4.0]))
    got.zero_()
    assert torch.equal(rt.blocking.download(buf), torch.tensor([0.0, 2.0, 4.0]))


def test_the_asyncio_api_pipelines(rt):
    async def main():
        bufs = await asyncio.gather(*(rt.upload(torch.full((3,), float(i))) for i in range(20)))
        outs = await asyncio.gather(*(rt.download(b) for b in bufs))
        replies = await asyncio.gather(*(rt.run(FaultRequest("none")) for _ in range(50)))
        return outs, replies

    outs, replies = asyncio.run(main())
    assert [float(o[0]) for o in outs] == [float(i) for i in range(20)]
    assert len(replies) == 50 and all(r.outputs == () for r in replies)


def test_freed_buffers_are_refused_before_anything_is_sent(rt):
    buf = rt.blocking.upload(torch.ones(4))
    rt.blocking.free(buf)
    with pytest.raises(StaleBuffer, match="slot generation None"):
        rt.blocking.download(buf)
    with pytest.raises(StaleBuffer):
        rt.blocking.free(buf)
    desc, x = _gated((4, 8))
    y = rt.blocking.upload(torch.zeros(4, 4))
    with pytest.raises(StaleBuffer):
        rt.blocking.run(GatedForwardRequest(desc, GatedActivationArgs(buf, y)))
    forged = Buffer("cpu", rt.worker_generation(), 10**6, 0, (4,), "f32")
    with pytest.raises(StaleBuffer):
        rt.blocking.download(forged)
    assert torch.equal(rt.blocking.download(y), torch.zeros(4, 4))  # nothing was written


def test_an_op_error_comes_back_and_the_worker_stays(rt):
    gen = rt.worker_generation()
    desc, x = _gated((4, 8))
    wrong = rt.blocking.upload(torch.zeros(4, 5))  # y of the wrong shape
    before = rt.blocking.download(wrong)
    with pytest.raises(InvalidProblem, match="y"):
        rt.blocking.run(GatedForwardRequest(desc, GatedActivationArgs(rt.blocking.upload(x), wrong)))
    assert torch.equal(rt.blocking.download(wrong), before) and rt.worker_generation() == gen


def test_requests_are_checked_when_built():
    desc, x = _gated((4, 8))
    with pytest.raises(InvalidProblem, match="upload it first"):
        GatedForwardRequest(desc, GatedActivationArgs(x, torch.zeros(4, 4)))
    with pytest.raises(InvalidProblem, match="GatedActivationArgs"):
        GatedForwardRequest(desc, GatedActivationBackwardArgs(None, None, None))
    gdesc = GemmDescriptor(m=2, n=2, k=2, dtype="f32", transb=True)
    with pytest.raises(InvalidProblem, match="fp8"):
        Fp8LinearRequest(gdesc, GemmArgs(None, None, None))
    with pytest.raises(InvalidProblem, match="kind"):
        FaultRequest("explode")


def test_a_fault_fails_what_is_in_flight_and_the_worker_restarts(backend):
    with Runtime(devices=("cpu",), backend=backend) as rt:  # one runtime through all three faults: generations 1 -> 4
        for kind, cause in CAUSES[backend].items():
            old = rt.blocking.upload(torch.ones(3))
            gen = rt.worker_generation()
            t0 = time.monotonic()
            fault = rt.submit_run(FaultRequest(kind))
            failed_at = []
            fault.add_done_callback(lambda f: failed_at.append(time.monotonic()))
            queued = [rt.submit_run(FaultRequest("sleep", 0.01)) for _ in range(3)]  # may wait for the restart
            with pytest.raises(DeviceFault, match=cause):
                fault.result(timeout=10)
            failed_s = failed_at[0] - t0
            # Each request behind the fault either reached the dying worker (and fails with it) or was not
            # delivered (and runs on the new worker): none hangs.
            for fut in queued:
                try:
                    assert fut.result(timeout=10).outputs == ()
                except DeviceFault as e:
                    assert cause in str(e)
            after = rt.blocking.upload(torch.full((2,), 7.0))  # waits for the new worker
            restarted_s = time.monotonic() - t0
            assert rt.worker_generation() == gen + 1
            assert torch.equal(rt.blocking.download(after), torch.full((2,), 7.0))
            with pytest.raises(StaleBuffer, match=f"holds worker generation {gen}, .* current worker generation {gen + 1}"):
                rt.blocking.download(old)
            assert failed_s < 2.0 and restarted_s < 10.0, (kind, failed_s, restarted_s)


def test_past_the_restart_intensity_the_device_is_failed(backend):
    with Runtime(devices=("cpu",), max_restarts=1, period_s=60, backend=backend) as rt:
        with pytest.raises(DeviceFault):
            rt.blocking.run(FaultRequest("exit"))
        rt.blocking.run(FaultRequest("none"))  # one restart allowed
        with pytest.raises(DeviceFault):
            rt.blocking.run(FaultRequest("exit"))
        with pytest.raises(DeviceFailed, match="restart intensity allows 1"):
            rt.blocking.run(FaultRequest("none"))


def test_a_thousand_requests_with_five_faults_each_answered_once(backend):
    rng = random.Random(0)
    faults = set(rng.sample(range(50, 950), 5))
    with Runtime(devices=("cpu",), max_restarts=10, backend=backend) as rt:
        futures, kinds = [], []
        for i in range(1000):  # at most 32 in flight, as a server's queue would keep them
            if i >= 32:
                concurrent.futures.wait([futures[i - 32]])
            kinds.append("fault" if i in faults else "ok")
            futures.append(rt.submit_run(FaultRequest("exit" if i in faults else "none")))
        answers = [0] * 1000
        for i, fut in enumerate(futures):
            fut.add_done_callback(lambda f, i=i: answers.__setitem__(i, answers[i] + 1))
        outcomes = []
        for fut in futures:
            try:
                fut.result(timeout=60)
                outcomes.append("ok")
            except DeviceFault:
                outcomes.append("fault")
        assert answers == [1] * 1000  # none lost, none answered twice
        assert all(o == "fault" for o, k in zip(outcomes, kinds) if k == "fault")
        # Requests in flight at a fault (at most the 31 behind it) fail with it; the rest succeed.
        assert outcomes.count("ok") >= 1000 - 5 * 32, outcomes.count("ok")
        for f in sorted(faults):  # sent after the fault was answered, and done before the next one could take it
            if not any(f < g <= f + 64 for g in faults):
                assert outcomes[f + 32:f + 33] in ([], ["ok"]), f
        assert rt.worker_generation() == 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_illegal_address_fails_in_flight_requests_and_recovers():
    with Runtime(devices=("cuda",)) as rt:  # "cuda" is cuda:0, and its buffers say so
        assert rt.devices == ("cuda:0",)
        desc = GatedActivationDescriptor("swiglu", (64, 256), 1, "bf16", device="cuda:0")
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        xb, yb = rt.blocking.upload(x), rt.blocking.upload(torch.zeros(64, 128, dtype=torch.bfloat16))
        ok = rt.blocking.run(GatedForwardRequest(desc, GatedActivationArgs(xb, yb)))
        assert ok.kernel_ms > 0
        t0 = time.monotonic()
        with pytest.raises(DeviceFault, match="sticky CUDA error"):
            rt.blocking.run(FaultRequest("illegal_address"))
        assert time.monotonic() - t0 < 2.0
        xb2, yb2 = rt.blocking.upload(x), rt.blocking.upload(torch.zeros(64, 128, dtype=torch.bfloat16))
        prepared = rt.blocking.prepare(GatedForwardRequest(desc, GatedActivationArgs(xb2, yb2)))
        assert rt.blocking.run(prepared).kernel_ms > 0
        want = torch.empty(64, 128, dtype=torch.bfloat16, device="cuda")
        GatedActivationPlan.select(desc).run(GatedActivationArgs(x, want))
        assert torch.equal(rt.blocking.download(yb2), want.cpu())
        with pytest.raises(StaleBuffer):
            rt.blocking.download(yb)


def test_the_worker_binds_a_request_once_checks_its_handles_each_run_and_forgets_it_when_a_buffer_goes():
    """In process, without a pipe: a request's bytes seen before run the bound plan (no second bind)."""
    import pickle

    from kernelplan.runtime.requests import GatedForwardRequest as Forward
    from kernelplan.runtime.worker import Worker

    worker = Worker("cpu", 1)
    x, y = torch.randn(4, 16), torch.zeros(4, 8)
    for i, t in enumerate((x, y)):
        worker.upload(i, 0, t.share_memory_())
    desc = GatedActivationDescriptor("swiglu", (4, 16), 1, "f32")
    request = Forward(desc, GatedActivationArgs(Buffer("cpu", 1, 0, 0, (4, 16), "float32"),
                                                Buffer("cpu", 1, 1, 0, (4, 8), "float32")))
    blob = pickle.dumps(request)
    binds = []
    real_bind = worker._bind
    worker._bind = lambda r: binds.append(r) or real_bind(r)
    for _ in range(3):
        sku, _ms = worker.run(blob)
    assert len(binds) == 1 and sku.backend and torch.equal(worker.tensor(request.args.y), y)
    expected = torch.empty(4, 8)
    GatedActivationPlan.select(desc).run(GatedActivationArgs(x, expected))
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    worker.free(0, 0)
    assert not worker.bound  # the bound request held x's tensor: it goes with the buffer
    with pytest.raises(StaleBuffer):
        worker.run(blob)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_2_4_request_run_again_through_its_bound_launch_matches_the_plan_run_here():
    """The worker runs a request it bound before through the plan's one-launch closure (``Plan.bound``)."""
    torch.manual_seed(0)
    with Runtime(devices=("cuda:0",)) as rt:
        b = rt.blocking
        for n, m, k, bias in ((1, 256, 512, False), (16, 512, 1024, True), (64, 384, 512, False),
                              (200, 512, 768, True)):
            w = compress(prune(torch.randn(m, k, device="cuda")).to(torch.bfloat16))
            x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            bb = torch.randn(m, device="cuda", dtype=torch.bfloat16) if bias else None
            desc = GemmSparse24Descriptor(n=n, m=m, k=k, dtype="bf16", device="cuda:0", has_bias=bias)
            plan = GemmSparse24Plan.select(desc)
            assert plan.bound(GemmSparse24Args(x, w.values, w.metadata, torch.empty(n, m, device="cuda",
                                                                                  dtype=torch.bfloat16), bb))
            here = torch.empty(n, m, device="cuda", dtype=torch.bfloat16)
            plan.run(GemmSparse24Args(x, w.values, w.metadata, here, bb))
            args = GemmSparse24Args(b.upload(x), b.upload(w.values), b.upload(w.metadata),
                                    b.upload(torch.zeros(n, m, device="cuda", dtype=torch.bfloat16)),
                                    b.upload(bb) if bias else None)
            request = Sparse24LinearRequest(desc, args)
            for _ in range(3):  # bound on the first run, its closure after
                b.run(request)
                assert torch.equal(b.download(args.y).cuda(), here), (n, m, k, bias)


def test_runtime_demo_shows_a_fault_and_the_recovery(tmp_path, capsys):
    """``kernelplan runtime-demo``: the requests in flight at the fault fail with DeviceFault, the restarted worker
    answers, the stream's last result is right, a freed handle is refused; the JSON holds the same."""
    import json

    from kernelplan.cli import main

    path = tmp_path / "demo.json"
    assert main(["runtime-demo", "--requests", "40", "--fault", "exit", "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    assert out["recovered"] and out["result_right"] and out["stale_refused"]
    assert out["generation_after"] == out["generation_before"] + 1 and "exited with code 3" in out["cause"]
    # The fault request fails, and with it at most the 15 others in flight; the rest ran.
    assert 1 <= out["failed"] <= 16 and out["ok"] == 40 - (out["failed"] - 1)
    assert out["fault_failed_s"] < 2.0 and out["restart_s"] < 10.0
    assert "runtime-demo: recovered" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--requests", "2"], "at least 4"),
    (["--fault", "illegal_address"], "launches a CUDA kernel"),
])
def test_runtime_demo_refuses_what_it_cannot_run(argv, message, capsys):
    from kernelplan.cli import main

    assert main(["runtime-demo", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_blocking_call_reads_its_own_reply_and_the_reader_thread_the_others():
    """``Runtime.blocking`` reads its reply in the calling thread, with no hand-over from the reader thread
    (``replies.py``); futures' replies are the reader thread's.  Callers on several threads beside futures in flight
    are each answered once."""
    with Runtime(devices=("cpu",)) as rt:
        stream = rt._workers["cpu"].stream
        for _ in range(20):
            assert rt.blocking.run(FaultRequest("none")).outputs == ()
        assert stream.served == 0  # none went through the reader thread
        futures = [rt.submit_run(FaultRequest("none")) for _ in range(20)]
        assert all(f.result(timeout=10).outputs == () for f in futures) and stream.served == 20
        buf = rt.blocking.upload(torch.arange(6.0))

        def mixed(i):
            if i % 3 == 0:
                return rt.submit_run(FaultRequest("sleep", 0.001)).result(timeout=10).outputs
            if i % 3 == 1:
                return rt.blocking.run(FaultRequest("none")).outputs
            return tuple(rt.blocking.download(buf).tolist())

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(mixed, range(300)))
        assert got == [() if i % 3 < 2 else (0.0, 1.0, 2.0, 3.0, 4.0, 5.0) for i in range(300)]
        assert stream.unattended == 0 and not rt._workers["cpu"].inflight


def test_a_worker_that_dies_idle_is_restarted_without_a_request():
    """Nothing in flight and no caller reading: the reader thread still looks at the pipe (``IDLE_LOOK_S``)."""
    with Runtime(devices=("cpu",)) as rt:
        gen = rt.worker_generation()
        os.kill(rt._workers["cpu"].proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while rt.worker_generation() == gen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rt.worker_generation() == gen + 1
        assert rt.blocking.run(FaultRequest("none")).outputs == ()
