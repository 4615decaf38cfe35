"""Ops with no autograd formula, for the calls that need none."""

from __future__ import annotations

import torch

_LIBRARY = torch.library.Library("kernelplan", "FRAGMENT")


def inference_op(schema: str, body, fake) -> "torch._ops.OpOverload":
    """The op ``kernelplan::<schema>``: ``body`` on every backend, ``fake`` for tracing; returns its overload.

    Registered through torch.library's low level, not ``torch.library.custom_op``: the dispatcher reaches the body
    without custom_op's Python autograd and aliasing layers.  An empty body took 4.8 us a call this way against
    custom_op's 8.1 under inference_mode, and 4.9 against 15.4 under no_grad (CPU CI host; docs/design/0075).
    A call that needs a gradient must take another op: this one has none."""
    name = schema[:schema.index("(")]
    _LIBRARY.define(schema)
    _LIBRARY.impl(name, body, "CompositeExplicitAutograd")
    torch.library.register_fake(f"kernelplan::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.kernelplan, name).default
