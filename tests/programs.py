"""Random draft-step programs for property tests (issue 11).

`programs()` is a hypothesis strategy. Each example is a `Program`: the Python source of a small
`torch.nn.Module` and its inputs, drawn from a grammar of draft steps (a KV write, attention,
row-local chains, row-mixing ops, a row gather in one of its spellings, a sampling tail; fewer
kv heads than query heads as enable_gqa or a head repeat of K/V, in interleave or tile order). The
source *is* the spec: `build()` executes it, and `repr()` prints it as a script that compares
specpass with eager, so a shrunk failure reads as a program to paste. Option lists name the
simplest choice first, as hypothesis shrinks toward it.
"""

from __future__ import annotations

import dataclasses
import itertools
import linecache
from typing import Callable

import torch
from hypothesis import strategies as st

TOLERANCE = {False: dict(rtol=1e-4, atol=1e-5), True: dict(rtol=3e-2, atol=3e-2)}  # by low_precision

_CHECK = """

if __name__ == "__main__":
    import copy
    import specpass
    eager = Program().eval()
    compiled = copy.deepcopy(eager)
    with torch.no_grad():
        print(specpass.explain(Program().eval(), *inputs()))
        want = eager(*inputs())
        got = torch.compile(compiled, backend=specpass.backend(handoff="eager"), fullgraph=True)(*inputs())
    torch.testing.assert_close(got, want, equal_nan=True, {tolerance})
    torch.testing.assert_close(compiled.state_dict(), eager.state_dict(), equal_nan=True, {tolerance})
"""

_count = itertools.count()


@dataclasses.dataclass(frozen=True)
class Program:
    source: str  # imports, `class Program(torch.nn.Module)`, `def inputs()`
    low_precision: bool  # a bf16/fp16 cast somewhere: compare floats loosely

    def __repr__(self) -> str:
        tolerance = ", ".join(f"{k}={v}" for k, v in TOLERANCE[self.low_precision].items())
        return self.source + _CHECK.format(tolerance=tolerance)

    def _repr_pretty_(self, printer, cycle) -> None:  # hypothesis prints examples with this
        printer.text("\n" + repr(self))

    def build(self) -> tuple[torch.nn.Module, Callable[[], tuple]]:
        """A fresh module (in eval mode) and the function that makes its inputs."""
        filename = f"<program {next(_count)}>"
        linecache.cache[filename] = (len(self.source), None, self.source.splitlines(True), filename)
        namespace: dict = {}
        exec(compile(self.source, filename, "exec"), namespace)
        return namespace["Program"]().eval(), namespace["inputs"]


@st.composite
def programs(draw) -> Program:
    return _Builder(draw).program()


@dataclasses.dataclass
class _Cache:
    name: str
    layout: str  # "bsd" [B, S, E]; "bshd" [B, S, Hkv, hd]; "bhsd" [B, Hkv, S, hd]
    slots: int  # S


class _Builder:
    """Draws one program stage by stage, tracking the stream `h`: [B, n, F], float32."""

    def __init__(self, draw):
        self.draw = draw
        self.B, self.T, self.D = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(4, 8))
        self.h, self.n, self.F = "x", self.T, self.D
        self.fresh = False  # h is an intermediate (in-place ops would not write an input)
        self.init: list[str] = []
        self.body: list[str] = []
        self.inputs = {"x": f"torch.randn({self.B}, {self.T}, {self.D})"}
        self.outputs: list[str] = []
        self.low_precision = False
        self.caches: list[_Cache] = []
        self.residual: tuple[str, int, int] | None = None  # (name, n, F) of a saved stream value
        self.names = itertools.count()
        self.live_drawn = False  # `live`, the [B] per-request row index, exists
        self.rows_source = "x"

    # -- drawing helpers ----------------------------------------------------------------------

    def pick(self, **weights: int) -> str:
        """One of the keywords, drawn with these weights (shrinks toward the first)."""
        return self.draw(st.sampled_from([name for name, w in weights.items() for _ in range(w)]))

    def integer(self, low: int, high: int) -> int:
        return self.draw(st.integers(low, high))

    def ints(self, low: int, high: int, size: int) -> list[int]:
        return self.draw(st.lists(st.integers(low, high), min_size=size, max_size=size))

    def param(self, *shape: int) -> str:
        name = f"self.w{next(self.names)}"
        self.init.append(f"{name} = torch.nn.Parameter(torch.randn({', '.join(map(str, shape))}) / {shape[-1]} ** 0.5)")
        return name

    def buffer(self, name: str, *shape: int) -> str:
        self.init.append(f'self.register_buffer("{name}", torch.randn({", ".join(map(str, shape))}))')
        return f"self.{name}"

    def emit(self, line: str) -> None:
        self.body.append(line)

    def update(self, expr: str, n: int | None = None, features: int | None = None, fresh: bool = True) -> None:
        self.emit(f"h = {expr}")
        self.h, self.fresh = "h", fresh
        self.n = self.n if n is None else n
        self.F = self.F if features is None else features

    # -- the program ----------------------------------------------------------------------------

    def program(self) -> Program:
        self.stream(2)
        if self.pick(no=1, yes=4) == "yes":
            self.attention()
        self.stream(4)
        if self.pick(no=6, yes=1) == "yes":
            self.late_write()
        self.finish()
        return Program(self.source(), self.low_precision)

    def source(self) -> str:
        init = "".join(f"        {line}\n" for line in self.init)
        body = "".join(f"        {line}\n" for line in self.body)
        outputs = ", ".join(self.outputs) + ("," if len(self.outputs) == 1 else "")
        values = ", ".join(self.inputs.values()) + ("," if len(self.inputs) == 1 else "")
        return (
            "import torch\nimport torch.nn.functional as F\n\n\n"
            "class Program(torch.nn.Module):\n"
            "    def __init__(self):\n        super().__init__()\n        torch.manual_seed(0)\n"
            f"{init}\n"
            f"    def forward(self, {', '.join(self.inputs)}):\n{body}        return {outputs}\n\n\n"
            f"def inputs():\n    torch.manual_seed(1)\n    return {values}\n"
        )

    # -- stream ops ---------------------------------------------------------------------------------

    def stream(self, most: int) -> None:
        """Up to `most` ops, drawn as a list so that the shrinker deletes whole ops."""
        self.draw(st.lists(st.composite(self.op)(), max_size=most))

    def op(self, draw) -> None:
        outer, self.draw = self.draw, draw  # the op's choices are one element of the list
        try:
            kind = self.pick(row_local=16, mixing=2, reorder=1, cache_read=1 if self.caches else 0)
            getattr(self, f"op_{kind}")()
        finally:
            self.draw = outer

    def op_row_local(self) -> None:
        h, n, F_, B = self.h, self.n, self.F, self.B
        kind = self.pick(unary=3, binary=3, linear=4, norm=2, reduce=2, cast=1, view=2,
                         composite=2, cat=1 if F_ <= 8 else 0, residual=2, in_place=2 if self.fresh else 0)
        if kind == "unary":
            self.update(f"{self.unary()}({h})")
        elif kind == "binary":
            form = self.pick(scale=2, bias=1, square=1, scalar=2, per_token=1, where=1, maximum=1)
            self.update({
                "scale": lambda: f"{h} * {self.param(F_)}",
                "bias": lambda: f"{h} + {self.param(1, 1, F_)}",
                "square": lambda: f"{h} * {h}",
                "scalar": lambda: f"{self.draw(st.sampled_from(['0.5 * ', '1.5 - ', '2.0 + ']))}{h}",
                "per_token": lambda: f"{h} * {self.param(n, 1)}",  # broadcast over features, per token
                "where": lambda: f"torch.where({h} > 0, {h}, 0.1 * {h})",
                "maximum": lambda: f"torch.maximum({h}, {self.param(F_)})",
            }[form]())
        elif kind == "linear":
            out = self.integer(4, 8)
            form = self.pick(linear=3, bias=1, matmul=1, einsum=1)
            self.update({
                "linear": lambda: f"F.linear({h}, {self.param(out, F_)})",
                "bias": lambda: f"F.linear({h}, {self.param(out, F_)}, {self.param(out)})",
                "matmul": lambda: f"{h} @ {self.param(F_, out)}",
                "einsum": lambda: f'torch.einsum("btf,fg->btg", {h}, {self.param(F_, out)})',
            }[form](), features=out)
        elif kind == "norm":
            form = self.pick(rms=2, rms_weight=1, layer=1, layer_affine=1)
            self.update({
                "rms": lambda: f"F.rms_norm({h}, ({F_},))",
                "rms_weight": lambda: f"F.rms_norm({h}, ({F_},), {self.param(F_)}, 1e-6)",
                "layer": lambda: f"F.layer_norm({h}, ({F_},))",
                "layer_affine": lambda: f"F.layer_norm({h}, ({F_},), {self.param(F_)}, {self.param(F_)})",
            }[form]())
        elif kind == "reduce":
            name = self.pick(mean=1, sum=1, std=1, var=1, amax=1, logsumexp=1)
            keep = self.pick(yes=2, no=1) == "yes"
            r = f"torch.logsumexp({h}, -1" if name == "logsumexp" else f"{h}.{name}(-1"
            r = f"{r}, keepdim=True)" if keep else f"{r})[..., None]"
            combine = self.pick(sub=1, mul=1, div=1)
            self.update({"sub": f"{h} - {r}", "mul": f"{h} * {r}", "div": f"{h} / ({r}.abs() + 1)"}[combine])
        elif kind == "cast":
            dtype = self.pick(bfloat16=1, float16=1)
            self.low_precision = True
            self.update(f"{self.unary()}({h}.to(torch.{dtype})).float()")
        elif kind == "view":
            form = self.pick(flat=2, unsqueeze=1, transpose=1 if F_ % 2 == 0 else 0)
            if form == "flat":
                out = self.integer(4, 8)
                flat = self.draw(st.sampled_from([f"reshape({B * n}, {F_})", f"view(-1, {F_})", "flatten(0, 1)"]))
                self.update(f"F.linear({h}.{flat}, {self.param(out, F_)}).reshape({B}, {n}, {out})", features=out)
            elif form == "unsqueeze":
                self.update(f"{self.unary()}({h}.unsqueeze(2)).squeeze(2)")
            else:
                self.update(f"{h}.view({B}, {n}, 2, {F_ // 2}).transpose(-1, -2).reshape({B}, {n}, {F_})",
                            fresh=self.fresh)
        elif kind == "composite":
            form = self.pick(hardswish=1, dropout=1, glu=1 if F_ % 2 == 0 and F_ >= 4 else 0,
                             softmax=1, normalize=1)
            self.update({
                "hardswish": f"F.hardswish({h})",
                "dropout": f"F.dropout({h}, 0.5, self.training)",
                "glu": f"F.glu({h}, -1)",
                "softmax": f"{h}.softmax(-1)",
                "normalize": f"F.normalize({h}, dim=-1)",
            }[form], features=F_ // 2 if form == "glu" else F_, fresh=form != "dropout" or self.fresh)
        elif kind == "cat":
            with_x = self.n == self.T and self.pick(self_unary=2, x=1) == "x"
            other, extra = ("x", self.D) if with_x else (f"{self.unary()}({h})", F_)
            self.update(f"torch.cat([{h}, {other}], -1)", features=F_ + extra)
        elif kind == "residual":
            saved = self.residual
            if saved is not None and saved[1:] == (n, F_) and self.pick(block=1, saved=2) == "saved":
                self.update(f"{h} + {saved[0]}")
            else:
                self.update(f"{h} + F.linear({self.unary()}({h}), {self.param(F_, F_)})")
            if self.pick(no=2, yes=1) == "yes":
                self.emit(f"r = {self.h}")  # an alias: in-place ops on h later also change r
                self.residual = ("r", self.n, self.F)
        else:
            self.emit(self.pick_in_place())

    def pick_in_place(self) -> str:
        form = self.pick(add=2, mul=2, relu=1, clamp=1, slice=1, center=1)
        return {
            "add": lambda: f"h.add_({self.param(self.F)})",
            "mul": lambda: "h.mul_(0.5)",
            "relu": lambda: "h.relu_()",
            "clamp": lambda: "h.clamp_(-1.0, 1.0)",
            "slice": lambda: "h[..., :1].mul_(2.0)",
            "center": lambda: "h.sub_(h.mean(-1, keepdim=True))",
        }[form]()

    def unary(self) -> str:
        return self.draw(st.sampled_from(["torch.relu", "F.silu", "F.gelu", "torch.tanh", "torch.sigmoid",
                                          "torch.neg", "torch.abs", "torch.square", "torch.sin", "torch.exp"]))

    def op_mixing(self) -> None:
        h, n, F_ = self.h, self.n, self.F
        form = self.pick(cumsum=1, softmax=1, center=1, normalize=1, roll=1, flip=1, shift=1,
                         matmul=1, einsum=1, conv1d=1, sort=1)
        self.update({
            "cumsum": lambda: f"{h}.cumsum(1)",
            "softmax": lambda: f"{h}.softmax(1)",
            "center": lambda: f"{h} - {h}.mean(1, keepdim=True)",
            "normalize": lambda: f"F.normalize({h}, dim=1)",
            "roll": lambda: f"{h}.roll(1, 1)",
            "flip": lambda: f"{h}.flip(1)",
            "shift": lambda: f"F.pad({h}[:, :-1], (0, 0, 1, 0))",
            "matmul": lambda: f"{self.param(n, n)} @ {h}",
            "einsum": lambda: f'torch.einsum("ts,bsf->btf", {self.param(n, n)}, {h})',
            "conv1d": lambda: f"F.conv1d({h}.transpose(1, 2), {self.param(F_, F_, 3)}, padding=1).transpose(1, 2)",
            "sort": lambda: f"{h}.sort(1).values",
        }[form]())

    def op_reorder(self) -> None:
        order = self.draw(st.lists(st.integers(0, self.n - 1), min_size=1, max_size=5))
        spelling = self.pick(index_select=2, list_index=1)
        expr = f"{self.h}.index_select(1, torch.tensor({order}))" if spelling == "index_select" \
            else f"{self.h}[:, {order}]"
        self.update(expr, n=len(order))

    def op_cache_read(self) -> None:
        cache = self.draw(st.sampled_from(self.caches))
        if cache.slots >= self.n and self.pick(aligned=2, pooled=1) == "aligned":
            self.add_cache_rows(cache, self.integer(0, cache.slots - self.n))
            return
        start = self.integer(0, cache.slots - 1)
        read = self.pool_features(self.cache_slice(cache, start, self.integer(start + 1, cache.slots)), cache.layout)
        self.update(f"{self.h} + {read}.mean(1, keepdim=True)")

    def add_cache_rows(self, cache: _Cache, start: int) -> None:
        """h + the cache's rows start:start + n, one per token, features pooled."""
        read = self.pool_features(self.cache_slice(cache, start, start + self.n), cache.layout)
        self.update(f"{self.h} + {read}")

    @staticmethod
    def cache_slice(cache: _Cache, start: int, stop: int) -> str:
        return f"self.{cache.name}[:, :, {start}:{stop}]" if cache.layout == "bhsd" \
            else f"self.{cache.name}[:, {start}:{stop}]"

    @staticmethod
    def pool_features(tokens: str, layout: str) -> str:
        """A cache slice as [B, m, 1]: broadcasts over the stream's features."""
        return {"bsd": f"{tokens}.mean(-1, keepdim=True)",
                "bshd": f"{tokens}.flatten(2).mean(-1, keepdim=True)",
                "bhsd": f"{tokens}.mean((1, 3)).unsqueeze(-1)"}[layout]

    # -- the KV write and attention ------------------------------------------------------------

    def attention(self) -> None:
        B, n = self.B, self.n
        heads = self.draw(st.sampled_from([1, 1, 1, 2, 2, 4, 6]))
        groups = self.draw(st.sampled_from([g for g in (2, 3, 4) if heads % g == 0])) \
            if heads > 1 and self.pick(no=1, yes=2) == "yes" else 1
        kv_heads = heads // groups
        head_dim = self.integer(2, 4)
        layout = self.pick(bsd=3 if heads == 1 else 0, bhsd=2, bshd=1)
        slots = n + self.integer(0, 3)
        start = self.integer(0, slots - n)
        kv = kv_heads * head_dim
        cache_shape = {"bsd": (B, slots, kv), "bshd": (B, slots, kv_heads, head_dim),
                       "bhsd": (B, kv_heads, slots, head_dim)}[layout]
        separate_v = self.pick(shared=2, separate=1) == "separate"
        caches = [_Cache("k_cache", layout, slots)] + ([_Cache("v_cache", layout, slots)] if separate_v else [])
        for cache in caches:
            self.buffer(cache.name, *cache_shape)

        read_before = self.pick(no=4, value=1, view=1)
        if read_before == "value":
            self.add_cache_rows(caches[0], start)
        if read_before == "view":  # taken before the write, read after it: sees the new rows
            self.emit(f"old = {self.cache_slice(caches[0], start, start + n)}")

        h = self.h
        self.emit(f"k = F.linear({h}, {self.param(kv, self.F)})")
        if separate_v:
            self.emit(f"v = F.linear({h}, {self.param(kv, self.F)})")
        heads_view = {"bsd": "{}", "bshd": f"{{}}.view({B}, {n}, {kv_heads}, {head_dim})",
                      "bhsd": f"{{}}.view({B}, {n}, {kv_heads}, {head_dim}).transpose(1, 2)"}[layout]
        write = self.pick(index_copy=3, slice=2, index_put=2, index_put_=1 if layout != "bhsd" else 0)
        if write in ("index_copy", "index_put", "index_put_"):
            self.inputs.setdefault("pos", f"torch.arange({start}, {start + n})")
            positions = "pos"
        else:
            positions = f"torch.arange({start}, {start + n})"
        from_cache = self.pick(cache=3, new_rows=1) == "cache"
        if layout == "bsd":
            keys = [f"self.{c.name}" for c in caches] if from_cache else ["k", "v"][:len(caches)]
        else:
            to_bhsd = ".transpose(1, 2)" if layout == "bshd" else ""
            keys = [f"self.{c.name}{to_bhsd}" for c in caches] if from_cache else \
                [f"{new}.view({B}, {n}, {kv_heads}, {head_dim}).transpose(1, 2)" for new in "kv"[:len(caches)]]
        if len(keys) == 1:
            keys.append(keys[0])
        key_len, query_slots = (slots, positions) if from_cache else (n, f"torch.arange({n})")

        # Grouped: SDPA's enable_gqa, or K/V repeated to every query head; a repeat of the cache
        # taken before the write is a copy of the old rows (or, of one kv head, a view of the cache).
        spelling = self.pick(native=2, repeat_kv=4, repeat_interleave=3, tile=2, cat=1) if groups > 1 else "native"
        early = spelling != "native" and self.pick(after_write=4, before_write=1) == "before_write"
        if early:
            keys = self.repeat_heads(keys, spelling, kv_heads, groups, key_len, head_dim)
        for cache, new in zip(caches, "kv"):
            rows, axis, buf = heads_view.format(new), 2 if layout == "bhsd" else 1, f"self.{cache.name}"
            self.emit({
                "index_copy": f"{buf}.index_copy_({axis}, pos, {rows})",
                "slice": f"{self.cache_slice(cache, start, start + n)} = {rows}",
                "index_put": f"{buf}[:, :, pos] = {rows}" if layout == "bhsd"
                else f"{buf}[torch.arange({B})[:, None], pos] = {rows}",
                "index_put_": f"{buf}.index_put_((torch.arange({B})[:, None], pos), {rows})",
            }[write])

        if spelling != "native" and not early:
            keys = self.repeat_heads(keys, spelling, kv_heads, groups, key_len, head_dim)

        q_dim = heads * head_dim
        q = f"F.linear({h}, {self.param(q_dim, self.F)})"
        if layout != "bsd":
            q = f"{q}.view({B}, {n}, {heads}, {head_dim}).transpose(1, 2)"
        mask = self.pick(none=1, bool=2, float=1, bias=1, causal=1)
        extra = ""
        if mask == "bool":
            self.emit(f"mask = torch.arange({key_len}) <= {query_slots}[:, None]")
        elif mask == "float":
            self.emit(f"mask = torch.zeros({n}, {key_len}).masked_fill("
                      f"torch.arange({key_len}) > {query_slots}[:, None], float('-inf'))")
        elif mask == "bias":
            self.emit(f"mask = {self.param(n, key_len)}")
        extra += ", attn_mask=mask" if mask in ("bool", "float", "bias") else ""
        extra += ", is_causal=True" if mask == "causal" else ""
        extra += ", enable_gqa=True" if groups > 1 and spelling == "native" else ""
        self.emit(f"a = F.scaled_dot_product_attention({q}, {keys[0]}, {keys[1]}{extra})")
        a = "a" if layout == "bsd" else f"a.transpose(1, 2).reshape({B}, {n}, {q_dim})"

        out = self.pick(raw=1, residual=3, project=1)
        if out == "residual":
            self.update(f"{h} + F.linear({a}, {self.param(self.F, q_dim)})")
        elif out == "project":
            features = self.integer(4, 8)
            self.update(f"F.linear({a}, {self.param(features, q_dim)})", features=features)
        else:
            self.update(a, features=q_dim)
        if read_before == "view":
            self.update(f"h + {self.pool_features('old', layout)}")
        if spelling != "native":
            self.use_repeat()
        self.caches += caches

    def repeat_heads(self, keys: list[str], spelling: str, kv_heads: int, groups: int, length: int,
                     head_dim: int) -> list[str]:
        """K and V [B, kv_heads, length, head_dim] repeated to every query head, as `kr` and `vr`
        (one name for one tensor): transformers' repeat_kv, repeat_interleave, or the tile order
        (query head j reads kv head j % kv_heads); V maybe spelled unlike K, or one of them not
        a repeat at all."""
        B, heads = self.B, kv_heads * groups
        spelled = {
            "repeat_kv": "{}[:, :, None].expand(" f"{B}, {kv_heads}, {groups}, {length}, {head_dim}).reshape("
                         f"{B}, {heads}, {length}, {head_dim})",
            "repeat_interleave": f"{{}}.repeat_interleave({groups}, dim=1)",
            "tile": f"{{}}.repeat(1, {groups}, 1, 1)",
            "cat": f"torch.cat([{{}}] * {groups}, 1)",
        }
        value_spelling = spelling if self.pick(same=6, other=1) == "same" else self.draw(st.sampled_from(list(spelled)))
        self.emit(f"kr = {spelled[spelling].format(keys[0])}")
        repeats = ["kr", "kr"]
        if (keys[1], value_spelling) != (keys[0], spelling):
            self.emit(f"vr = {spelled[value_spelling].format(keys[1])}")
            repeats[1] = "vr"
        not_a_repeat = self.pick(neither=10, key=1, value=1)  # its heads made to differ
        if not_a_repeat != "neither":
            i = 0 if not_a_repeat == "key" else 1
            repeats[i] = f"{repeats[i]}.flip(1)" if self.pick(flip=1, scale=1) == "flip" \
                else f"{repeats[i]} * {self.param(heads, 1, 1)}"
        return repeats

    def use_repeat(self) -> None:
        """The repeated K (`kr`, [B, heads, length, head_dim]) used again after attention."""
        use = self.pick(none=6, returned=1, read=1, written=1)
        if use == "returned":
            self.outputs.append("kr")
        elif use == "read":
            self.update(f"{self.h} + kr.mean((1, 2, 3))[:, None, None]")
        elif use == "written":  # kr is a view of what it repeats where repeat_kv repeats one kv head
            self.emit("kr[:, :1].mul_(0.5)")

    def late_write(self) -> None:
        """The stream written whole to a second buffer: every row is needed."""
        start = self.integer(0, 2)
        state = self.buffer("state", self.B, self.n + start, self.F)
        form = self.pick(slice=1, index_copy=1)
        self.emit(f"{state}[:, {start}:] = {self.h}" if form == "slice"
                  else f"{state}.index_copy_(1, torch.arange({start}, {start + self.n}), {self.h})")

    # -- the end of the step: head, gather, sampling tail, outputs --------------------------------

    def finish(self) -> None:
        head = self.pick(none=1, lm_head=4) == "lm_head"
        full, full_n, full_F = self.h, self.n, self.F
        if head:
            vocab = self.integer(5, 12)
            self.emit(f"logits = F.linear({self.h}, {self.param(vocab, self.F)})")
            z, rest = "logits", [vocab]
        else:
            z, rest = self.h, [self.F]
        if self.pick(no=6, yes=1) == "yes":
            order = self.draw(st.lists(st.integers(0, self.n - 1), min_size=1, max_size=5))
            self.emit(f"z = {z}.index_select(1, torch.tensor({order}))")
            z, self.n = "z", len(order)

        self.rows_source = z  # [B, n, *]: what a per-request index computed from data reads
        tail = self.pick(none=3, after=3, before=1) if head else "none"
        selected: list[tuple[str, list[int]]]
        if tail == "before":  # sampling on every row, then the gather of its results
            selected = self.sampling(z, rest, token_axis=True)
        else:
            selected = [(z, rest)]
        spelling = self.pick(last=4, tail_k=2, range=1, narrow=1, select=1, per_request=4,
                             per_request_2d=1, flat_static=2, flat_runtime=2, flat_ids=1, batch=1, gather=2,
                             none=1 if self.body else 0)  # an empty graph: Dynamo compiles nothing
        gathered = [(self.gather(spelling, value, value_rest), value_rest) for value, value_rest in selected]
        if tail == "after":
            (value, value_rest), = gathered
            self.emit(f"g = {value}")
            self.outputs += [out for out, _ in self.sampling("g", value_rest, token_axis=False)]
            if self.pick(no=2, yes=1) == "yes":
                self.outputs.append("g")
        else:
            self.outputs += [value for value, _ in gathered]

        second = self.pick(none=6, full=1, gathered=2 if head and full_n == self.n else 0)
        if second == "full":
            self.outputs.append(full)
        elif second == "gathered":
            self.outputs.append(self.gather(spelling, full, [full_F]))
        cache_out = self.pick(no=5, view=1, whole=1) if self.caches else "no"
        if cache_out != "no":
            cache = self.caches[0]
            self.outputs.append(self.cache_slice(cache, 0, self.n) if cache_out == "view" else f"self.{cache.name}")

    def sampling(self, logits: str, rest: list[int], token_axis: bool) -> list[tuple[str, list[int]]]:
        """softmax / log_softmax -> max / topk / argmax / amax over the last axis."""
        s = logits
        precast = self.pick(none=4, float=1, double=1, bfloat16=1)
        s = {"none": s, "float": f"{s}.float()", "double": f"{s}.double()", "bfloat16": f"{s}.bfloat16()"}[precast]
        temperature = self.pick(none=3, positive=2, scale=1, negative=1, zero=1, tensor=1)
        if temperature == "tensor":
            self.inputs["temperature"] = f"torch.tensor({self.draw(st.sampled_from([0.7, -0.5, 0.0]))})"
        s = {"none": s, "positive": f"{s} / 0.7", "scale": f"{s} * 1.5", "negative": f"{s} / -0.5",
             "zero": f"{s} / 0.0", "tensor": f"{s} / temperature"}[temperature]
        op = self.pick(softmax=3, log_softmax=1)
        dtype = self.pick(none=3, float32=1, float64=1)
        low = precast == "bfloat16" and dtype == "none"
        p = f"torch.{op}({s}, -1)" if dtype == "none" else f"torch.{op}({s}, -1, dtype=torch.{dtype})"
        postcast = self.pick(none=4, float=1, bfloat16=1)
        p += {"none": "", "float": ".float()", "bfloat16": ".bfloat16()"}[postcast]
        low = (low and postcast != "float") or postcast == "bfloat16"
        self.low_precision |= precast == "bfloat16" or postcast == "bfloat16"
        self.emit(f"p = {p}")
        vocab, lead = rest[-1], rest[:-1]
        k = self.integer(1, min(vocab, 3))
        # Low-precision probabilities tie; which index wins a tie is not specified: values only.
        consumer = self.pick(max=3, argmax=2 if not low else 0, topk=2, amax=1,
                             max_all=0 if token_axis else 1, other_axis=0 if token_axis else 1, smallest=1)
        values_only = low or self.pick(both=2, one=1) == "one"
        if consumer == "max":
            return [("p.max(-1).values", lead)] if values_only else \
                [("p.max(-1).values", lead), ("p.max(-1).indices", lead)]
        if consumer == "topk" or consumer == "smallest":
            call = f"p.topk({k}, -1)" if consumer == "topk" else f"p.topk({k}, -1, largest=False)"
            return [(f"{call}.values", lead + [k])] if values_only else \
                [(f"{call}.values", lead + [k]), (f"{call}.indices", lead + [k])]
        return [{"argmax": ("p.argmax(-1)", lead), "amax": ("p.amax(-1)", lead), "max_all": ("p.max()", []),
                 "other_axis": ("p.amax(0)", [])}[consumer]]  # other_axis: not the softmax's

    def gather(self, spelling: str, z: str, rest: list[int]) -> str:
        """`z` [B, n, *rest] -> its selected rows, spelled as drawn."""
        B, n = self.B, self.n
        flat = f"{z}.reshape({', '.join(map(str, [B * n] + rest))})"
        if spelling == "last":
            return f"{z}[:, -1]"
        if spelling == "tail_k":
            return f"{z}[:, -{self.integer(1, n)}:]"
        if spelling == "range":
            start = self.integer(0, n - 1)
            return f"{z}[:, {start}:{self.integer(start + 1, n)}:{self.integer(1, 2)}]"
        if spelling == "narrow":
            start = self.integer(0, n - 1)
            return f"{z}.narrow(1, {start}, {self.integer(1, n - start)})"
        if spelling == "select":
            return f"{z}.select(1, {self.integer(-n, n - 1)})"
        if spelling == "per_request":
            return f"{z}[torch.arange({B}), {self.per_request_index()}]"
        if spelling == "per_request_2d":
            rows = self.integer(1, 3)
            self.inputs.setdefault("idx", f"torch.tensor({[self.ints(0, n - 1, rows) for _ in range(B)]})")
            return f"{z}[torch.arange({B})[:, None], idx]"
        if spelling == "flat_static":
            return f"{flat}.index_select(0, torch.arange({B}) * {n} + {n - 1})"
        if spelling == "flat_runtime":
            live = self.per_request_index()
            if live.endswith(f"- {n}"):  # negative: only plain indexing wraps around
                return f"{flat}[torch.arange({B}) * {n} + {live}]"
            form = self.pick(index_select=1, index=1)
            return f"{flat}.index_select(0, torch.arange({B}) * {n} + {live})" if form == "index_select" \
                else f"{flat}[torch.arange({B}) * {n} + {live}]"
        if spelling == "flat_ids":
            self.inputs.setdefault("ids", f"torch.tensor({self.ints(0, B * n - 1, self.integer(1, 4))})")
            return f"{flat}[ids]"
        if spelling == "batch":
            if self.pick(number=1, ids=1) == "number":
                return f"{z}[{self.integer(-B, B - 1)}]"
            self.inputs.setdefault("requests", f"torch.tensor({self.ints(0, B - 1, self.integer(1, 3))})")
            return f"{z}[requests]"
        if spelling == "gather":
            index = f"{self.per_request_index(negative=False)}[:, None]"
            index = f"{index}[..., None].expand(-1, 1, {', '.join(map(str, rest))})" if rest else index
            return f"torch.gather({z}, 1, {index})"
        return z

    def per_request_index(self, negative: bool = True) -> str:
        """A [B] index of one row per request: an input, or computed from data; maybe negative."""
        if not self.live_drawn:
            source = self.pick(input=4, from_x=1 if self.n == self.T else 0, from_rows=1)
            if source == "input":
                self.inputs["live"] = f"torch.tensor({self.ints(0, self.n - 1, self.B)})"
            else:  # an argmax over the token axis: in [0, n)
                self.emit(f"live = {'x' if source == 'from_x' else self.rows_source}.sum(-1).argmax(-1)")
            self.live_drawn = True
        if negative and self.pick(no=3, yes=1) == "yes":
            return f"live - {self.n}"
        return "live"
