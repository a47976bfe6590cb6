"""Row selections through reshapes: where a view merges or splits the selected axis with others.

`-1` on `[B, T, H]` read as `[B * T, H]` is the flat ids `arange(B) * T + T - 1`; split back into
`[B, T, H]`, ids that pick the same rows of every request are the static slice they spell
(`x[:, -1]`), and ids built from a per-request index are that index again. So two spellings of the
same rows meet as one selection, and attention can take per-request rows without copying K/V.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from specpass.graph import is_symbolic, known, same_shape
from specpass.passes.live_rows.program import Program, constant
from specpass.passes.live_rows.rows import Flat, PerBatch, Rows, Static
from specpass.passes.row_rules import Stop

aten = torch.ops.aten


def through_reshape(prog: Program, spec: Rows, in_shape: list[int], out_shape: list[int],
                    device: torch.device) -> Rows | None:
    """The input selection of a reshape whose output is gathered by `spec` (None: every row).

    Axes the reshape leaves alone keep the selection; where it merges or splits a selected axis
    with others, the rows become flat ids over the merged axes.
    """
    spec = spec.normalize(prog, out_shape)
    if spec is None:
        return None
    groups = _reshape_groups(in_shape, out_shape)
    touched = [(ins, outs) for ins, outs in groups if set(outs) & set(spec.axes)]
    outs_big = [a for _, outs in touched for a in outs if not known(out_shape[a] == 1)]
    ins_big = [a for ins, _ in touched for a in ins if not known(in_shape[a] == 1)]
    if isinstance(spec, Static) and outs_big == [spec.axis] and len(ins_big) == 1:
        return dataclasses.replace(spec, axis=ins_big[0])
    if isinstance(spec, PerBatch) and len(touched) == 2 and outs_big == [spec.batch, spec.axis]:
        if len(ins_big) == 2:
            return dataclasses.replace(spec, batch=ins_big[0], axis=ins_big[1])
        coarser, sizes = prog.spread.get(spec.index, (None, None))
        if coarser is not None and same_shape([in_shape[a] for a in ins_big[2:]], sizes):
            # The reshape splits the row axis back into (rows, every row of the rest), e.g.
            # attention's query rows T * heads -> [T, heads]: select the coarser rows.
            return PerBatch(ins_big[0], ins_big[1], coarser)
    if not (isinstance(spec, Flat) and list(spec.axes) == outs_big):
        spec = spec.as_flat(prog, outs_big, out_shape, device)
    if len(ins_big) == 2:
        per_batch = _split_per_batch(prog, spec.index, in_shape[ins_big[0]], in_shape[ins_big[1]])
        if per_batch is not None:  # same row order, and attention can take it without copying K/V
            return canonical(PerBatch(ins_big[0], ins_big[1], per_batch), in_shape)
    return Flat(tuple(ins_big), spec.index)


def canonical(spec: Rows, shape: list[int]) -> Rows:
    """A per-request selection of the same constant range in every request is the static slice it
    spells (`arange(B) * T + T - 1` on [B * T], `x[arange(B), full(B, T - 1)]`: `x[:, -1]`), so
    that two spellings of the same rows meet as one selection."""
    if not isinstance(spec, PerBatch):
        return spec
    rows = constant(spec.index)
    if rows is None or rows.numel() == 0 or is_symbolic(shape[spec.axis]):
        return spec
    rows = rows % shape[spec.axis]
    first = rows[0].tolist()
    step = first[1] - first[0] if len(first) > 1 else 1
    span = range(first[0], first[0] + step * len(first), step) if step > 0 else None
    if span is None or not torch.equal(rows, torch.tensor(list(span)).expand_as(rows)):
        return spec
    return Static(spec.axis, span.start, span.stop, span.step)


def _reshape_groups(in_shape: list[int], out_shape: list[int]) -> list[tuple[list[int], list[int]]]:
    """Split a reshape into (input axes, output axes) groups with equal element counts."""
    groups, i, j = [], 0, 0
    while i < len(in_shape) or j < len(out_shape):
        gi, go, pi, po = [], [], 1, 1
        while True:
            if i < len(in_shape) and (not gi or known(pi < po)):
                gi.append(i)
                pi *= in_shape[i]
                i += 1
            elif j < len(out_shape) and (not go or known(po < pi)):
                go.append(j)
                po *= out_shape[j]
                j += 1
            elif known(pi == po):
                break
            else:
                raise Stop("a reshape whose axes do not provably group (a zero-size axis, or symbolic sizes)")
        groups.append((gi, go))
    return groups


def _split_per_batch(prog: Program, ids: fx.Node, B: int, T: int) -> fx.Node | None:
    """Flat ids over [B * T] that provably pick k rows of every request in order — built from a
    per-request index, or computed from constants only (arange(B) * T + T - 1) — as a [B, k]
    per-request index; else None."""
    built = prog.per_request.get(ids)
    if built is not None and same_shape(built[1:], (B, T)):
        return built[0]
    value = constant(ids)
    if value is None or is_symbolic(B) or is_symbolic(T) or value.numel() % B:
        return None
    rows = value.reshape(B, -1)
    if not torch.equal(rows // T, torch.arange(B).unsqueeze(1).expand_as(rows)):
        return None
    return prog.index_op(aten.reshape.default, prog.index_op(aten.remainder.Scalar, ids, T), [B, rows.shape[1]])
