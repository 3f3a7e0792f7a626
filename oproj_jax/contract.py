"""The op's contract, in one place: what a call takes and returns, and the argument checks.

`consumer(mailbox, prefix, blocks, norm, query, out_norm, **options) -> ConsumerResult` on JAX
arrays (api.py), and the same on torch tensors (the Triton kernel's PyTorch entry and the
independent torch reference), both checked here before any backend runs. docs/spec.md defines
the op; oproj_jax/options.py the options.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from oproj_jax.options import Options

MAX_BLOCKS = 8  # completed blocks (NB) a call mixes: the Block AttnRes window
HIDDEN = 7168  # the hidden size of the production model; the CuTe cubins are built for it alone


class ConsumerResult(NamedTuple):
    prefix: jax.Array  # [T, H] bf16: the updated partial-block residual (written back)
    output: jax.Array  # [T, H] bf16: the normalized input of the next sub-layer
    xmoe: jax.Array | None  # [reps, T, H] bf16, -0.0 written as +0.0; None when reps == 0


class Dims(NamedTuple):
    R: int  # ranks (mailbox slots)
    T: int  # tokens
    NB: int  # completed blocks
    H: int  # hidden size


def check_array(name: str, x: Any, ndim: int, layout: str) -> tuple[int, ...]:
    if type(x).__module__.split(".")[0] == "torch":
        raise TypeError(
            f"{name}: expected a JAX (or numpy) bf16 array of shape {layout}, got a torch.Tensor; convert "
            f"it with jax.dlpack.from_dlpack(tensor) (zero-copy on the same device), or use "
            f"oproj_jax.torch_ref for PyTorch"
        )
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected a bf16 array of shape {layout}, got {type(x).__name__}")
    try:
        dtype = jnp.dtype(x.dtype)
    except TypeError:
        dtype = None
    if dtype != jnp.bfloat16:
        raise TypeError(f"{name}: expected dtype bfloat16 (shape {layout}), got {x.dtype}")
    if len(x.shape) != ndim:
        raise ValueError(f"{name}: expected rank {ndim} ({layout}), got shape {tuple(x.shape)}")
    return tuple(int(d) for d in x.shape)


def check_arguments(mailbox, prefix, blocks, norm, query, out_norm, **options) -> Dims:
    """Checks dtypes, ranks, shapes, then the options (Options.from_kwargs: the missing ones at
    their defaults); returns the dimensions. Raises TypeError/ValueError."""
    R, T, H = check_array("mailbox", mailbox, 3, "[R, T, H]")
    if T < 1:  # rejected, not an empty result: every kernel's grid is T; skip the call for an empty batch
        raise ValueError(
            f"mailbox: expected T >= 1 tokens (shape [R, T, H]), got T = 0 in shape {(R, T, H)}; "
            f"there is nothing to consume: skip the call for an empty batch"
        )
    if R < 1 or H < 1:
        raise ValueError(f"mailbox: expected R >= 1 and H >= 1 (shape [R, T, H]), got shape {(R, T, H)}")
    prefix_shape = check_array("prefix", prefix, 2, "[T, H]")
    if prefix_shape != (T, H):
        raise ValueError(f"prefix: expected shape [T, H] = {(T, H)} (from mailbox), got {prefix_shape}")
    bT, NB, bH = check_array("blocks", blocks, 3, "[T, NB, H]")
    if (bT, bH) != (T, H):
        raise ValueError(f"blocks: expected shape [T, NB, H] with T={T}, H={H}, got {(bT, NB, bH)}")
    if NB > MAX_BLOCKS:
        raise ValueError(f"blocks: expected at most {MAX_BLOCKS} completed blocks (NB), got NB={NB}")
    for name, w in (("norm", norm), ("query", query), ("out_norm", out_norm)):
        (wH,) = check_array(name, w, 1, "[H]")
        if wH != H:
            raise ValueError(f"{name}: expected shape [H] = ({H},) (from mailbox), got ({wH},)")
    Options.from_kwargs(options)
    return Dims(R, T, NB, H)


def _check_rank(rank: Any, R: int, given: bool) -> int:
    """`rank`, the mailbox slot an own partial stands for (0 <= rank < R; 0 when none is `given`)."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
        raise TypeError(
            f"rank: expected a Python int (static: the mailbox slot `partial` stands for), got {type(rank).__name__}"
        )
    if not given:
        if rank != 0:
            raise ValueError(f"rank: names the slot of `partial`, which is None; got rank={rank} without a partial")
        return 0
    if not 0 <= rank < R:
        raise ValueError(f"rank: expected 0 <= rank < R = {R} (mailbox slots), got {rank}")
    return int(rank)


def check_partial(partial, rank: Any, dims: Dims) -> int:
    """The caller's own partial: `partial` [T, H] bf16 stands for mailbox slot `rank` (a Python
    int, 0 <= rank < R); partial None leaves rank at 0. Returns rank. Raises TypeError/ValueError
    naming the argument."""
    rank = _check_rank(rank, dims.R, partial is not None)
    if partial is None:
        return rank
    shape = check_array("partial", partial, 2, "[T, H]")
    if shape != (dims.T, dims.H):
        raise ValueError(f"partial: expected shape [T, H] = {(dims.T, dims.H)} (from mailbox), got {shape}")
    return rank


# ---- the PyTorch entry ------------------------------------------------------------------------


class TorchResult(NamedTuple):
    prefix: Any  # [T, H] bf16 torch.Tensor: the updated partial-block residual
    output: Any  # [T, H] bf16 torch.Tensor
    xmoe: Any  # [reps, T, H] bf16 torch.Tensor with -0.0 written as +0.0; None when reps == 0


def check_tensor_partial(torch, partial, rank: Any, mailbox) -> int:
    """check_partial for the PyTorch entry: `partial` None or a bf16 torch.Tensor [T, H] on the
    mailbox's device (check_tensors has checked the mailbox). Returns rank."""
    R, T, H = mailbox.shape
    rank = _check_rank(rank, R, partial is not None)
    if partial is None:
        return rank
    if not isinstance(partial, torch.Tensor) or partial.dtype != torch.bfloat16:
        got = partial.dtype if isinstance(partial, torch.Tensor) else type(partial).__name__
        raise TypeError(f"partial: expected None or a bfloat16 torch.Tensor [T, H], got {got}")
    if partial.device != mailbox.device:
        raise ValueError(f"partial: expected device {mailbox.device} (from mailbox), got {partial.device}")
    if tuple(partial.shape) != (T, H):
        raise ValueError(f"partial: expected shape [T, H] = {(T, H)} (from mailbox), got {tuple(partial.shape)}")
    return rank


def check_tensors(torch, mailbox, prefix, blocks, norm, query, out_norm) -> None:
    """Dtypes, devices and shapes of the six tensors (TypeError / ValueError naming the argument);
    the Triton kernel's PyTorch entry and the torch reference check with it."""
    named = dict(mailbox=mailbox, prefix=prefix, blocks=blocks, norm=norm, query=query, out_norm=out_norm)
    for name, x in named.items():
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"{name}: expected a bfloat16 torch.Tensor, got {got}")
        if x.device != mailbox.device:
            raise ValueError(f"{name}: expected device {mailbox.device} (from mailbox), got {x.device}")
    if mailbox.dim() != 3:
        raise ValueError(f"mailbox: expected shape [R, T, H], got {tuple(mailbox.shape)}")
    R, T, H = mailbox.shape
    want = dict(prefix=(T, H), norm=(H,), query=(H,), out_norm=(H,))
    for name, shape in want.items():
        if tuple(named[name].shape) != shape:
            got = tuple(named[name].shape)
            raise ValueError(f"{name}: expected shape {shape} (from mailbox [R, T, H]), got {got}")
    if blocks.dim() != 3 or (blocks.shape[0], blocks.shape[2]) != (T, H) or blocks.shape[1] > MAX_BLOCKS:
        raise ValueError(
            f"blocks: expected shape [T, NB, H] = ({T}, NB <= {MAX_BLOCKS}, {H}), got {tuple(blocks.shape)}"
        )
