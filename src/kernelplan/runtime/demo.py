"""``kernelplan runtime-demo``: a fault injected into a running stream of requests, and the recovery, timed.

A stream of real requests (a SwiGLU forward on uploaded buffers, at most 16 in
flight, as a server's queue keeps them) runs on one device's worker; halfway, a
``FaultRequest`` kills the worker (``exit``, ``kill``, ``sticky``, or on a GPU
``illegal_address``: a kernel that writes out of bounds).  The demo reports
when the requests in flight failed with ``DeviceFault``, when the restarted
worker answered, that the old buffers are refused (``StaleBuffer``), and that
the stream goes on once its buffers are uploaded again.
"""

from __future__ import annotations

import concurrent.futures
import time

IN_FLIGHT = 16


def run_demo(device: str = "cpu", fault: str = "exit", requests: int = 200, say=print) -> dict:
    """The drill on ``device``; returns its timings and counts (``recovered``: every check held)."""
    import torch

    from ..gated import GatedActivationArgs, GatedActivationDescriptor
    from .client import Runtime
    from .errors import DeviceFault, StaleBuffer
    from .requests import FaultRequest, GatedForwardRequest

    dtype = torch.bfloat16
    desc = GatedActivationDescriptor("swiglu", (64, 512), 1, "bf16", device=device)
    x = torch.randn(64, 512, dtype=dtype)
    want = x[:, :256].float() * torch.nn.functional.silu(x[:, 256:].float())  # gate="second": a * silu(b)
    half = requests // 2
    out: dict = {"device": device, "fault": fault, "requests": requests}
    say(f"runtime-demo: {requests} SwiGLU forward requests on {device}, at most {IN_FLIGHT} in flight; "
        f"a {fault!r} fault injected after request {half}")
    t_start = time.monotonic()
    with Runtime(devices=(device,)) as rt:
        out["start_s"] = time.monotonic() - t_start
        def upload():  # the stream's input and output buffers
            return GatedActivationArgs(rt.blocking.upload(x), rt.blocking.upload(torch.empty(64, 256, dtype=dtype)))

        args = upload()
        generation = rt.worker_generation(device)
        futures, kinds, fault_at, done_at = [], [], None, {}
        for i in range(requests + 1):
            if len(futures) >= IN_FLIGHT:
                concurrent.futures.wait([futures[-IN_FLIGHT]])
            if i == half:
                fault_at = time.monotonic()
                fut = rt.submit_run(FaultRequest(fault))
                kinds.append("fault")
            else:
                try:
                    fut = rt.submit_run(GatedForwardRequest(desc, args))
                except StaleBuffer:  # the worker restarted: this stream's buffers went with the old one
                    args, out["reuploaded_at"] = upload(), i
                    fut = rt.submit_run(GatedForwardRequest(desc, args))
                kinds.append("work")
            fut.add_done_callback(lambda f, i=i: done_at.setdefault(i, time.monotonic()))  # when it was answered
            futures.append(fut)
        failed_at, outcomes, causes = [], [], set()
        for i, fut in enumerate(futures):
            try:
                fut.result(timeout=60)
                outcomes.append("ok")
            except DeviceFault as e:
                failed_at.append(done_at[i])
                outcomes.append("fault")
                causes.add(str(e).split("died (")[-1].split(")")[0])
        out["ok"], out["failed"] = outcomes.count("ok"), outcomes.count("fault")
        out["cause"] = "; ".join(sorted(causes))
        # The first request sent after the fault that ran: the restarted worker's first answer.
        later = [i for i in range(half + 1, len(futures)) if kinds[i] == "work" and not futures[i].exception()]
        out["fault_failed_s"] = (min(failed_at) - fault_at) if failed_at else None
        out["generation_before"], out["generation_after"] = generation, rt.worker_generation(device)
        got = rt.blocking.download(args.y).float()
        out["result_right"] = bool(torch.allclose(got, want, atol=2e-2, rtol=2e-2))
        stale = rt.blocking.upload(torch.ones(1))
        rt.free(stale)
        try:
            rt.blocking.download(stale)
            out["stale_refused"] = False
        except StaleBuffer as e:
            out["stale_refused"], out["stale_message"] = True, str(e)
        out["restart_s"] = min(done_at[i] for i in later) - fault_at if later else None
    out["recovered"] = bool(out["failed"] >= 1 and later and out["result_right"] and out["stale_refused"]
                            and out["generation_after"] == generation + 1)
    say(f"  worker started in {out['start_s']:.2f} s (generation {generation})")
    say(f"  fault: {out['failed']} request(s) failed with DeviceFault ({out['cause']}), the first "
        f"{out['fault_failed_s']:.3f} s after the fault was sent" if out["fault_failed_s"] is not None else
        "  fault: no request failed")
    say(f"  restart: generation {out['generation_after']} answered {out['restart_s']:.2f} s after the fault"
        if out["restart_s"] is not None else "  restart: no request ran after the fault")
    say(f"  {out['ok']} of {requests} requests succeeded (the others were in flight at the fault); the stream "
        f"re-uploaded its buffers at request {out.get('reuploaded_at', '-')}; the last result is {'right' if out['result_right'] else 'WRONG'}")
    say(f"  a freed handle: {'refused (StaleBuffer)' if out['stale_refused'] else 'NOT refused'}")
    say(f"runtime-demo: {'recovered' if out['recovered'] else 'did NOT recover'}")
    return out
