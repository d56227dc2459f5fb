"""Pass ``functionalize``: the dynamo graph made functional, before anything decides placements.

Invariant: afterwards no node mutates a value the graph computed, and every
node reads the value its input has at that point of the program. An in-place
op (``x.mul_(2)``, ``x += y``, ``F.silu(x, inplace=True)``, ``x[:, 0] = 0``,
``x.copy_(y)``) becomes its out-of-place form; every later reader of the
mutated memory, through an alias (``h = x``) or a view made before the
mutation (``v = x.view(...)``), is given the new value, re-derived by
replaying its view chain on the new base. A mutation through a view is
written back into its base with ``slice_scatter`` / ``select_scatter`` or
the inverse reshape, transpose or permute. Mutated graph inputs (buffers, a
cache, the caller's tensors) keep their semantics through one ``copy_`` into
the input at the end of the graph, as AOTAutograd does; on a parallelized
model that copy is the only mutation left, and a parameter mutated in the
forward is refused. What cannot be made functional exactly raises
:class:`~boost_compiler.errors.MutationError` naming the op and the user's
source line, before any parameter is modified.

Why not torch's own functionalization (``torch.func.functionalize`` under
``make_fx``, what AOTAutograd runs): it produces ATen ops (``aten.mm``,
``aten._unsafe_view``, decomposed norms), and every later stage here (bottleneck
detection, the sharding rules, the shadow module's tracing) works on the
torch-level ops dynamo emits; see ``docs/placement-ir.md`` for that decision.
Aliasing is read from the same source torch uses, the fake tensors' storages:
two values alias exactly when their ``example_value`` shares a storage.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..errors import MutationError
from ..ir.ops import shape_of, value_of
from ..ir.writes import (
    _IDENTITY_VIEWS,
    _INPLACE_OPERATOR,
    _RANDOM,
    _RESHAPES,
    _SELF_INVERSE,
    _basic_index,
    _bind,
    _functional_method,
    _index_steps,
    _inplace_flag,
    _mutated_arg,
    _op,
    _storage_key,
    _tensor_index,
    _viewed_input,
    _where,
    is_mutation,
    written_inputs,
)
from .base import BoostPass


class Functionalize(BoostPass):
    name = "functionalize"
    depends_on = ("boost_compiler.ir.ops", "boost_compiler.ir.writes")

    def run(self, graph: fx.Graph) -> None:
        tp = self.ctx.tp is not None
        _Functionalizer(graph, set(self.ctx.param_names), refuse_params=tp).run()


@dataclass
class _Storage:
    root: fx.Node  # the node that created this memory (a placeholder for an input)
    base: fx.Node  # the node holding the root's value now
    version: int = 0


class _Functionalizer:
    def __init__(self, graph: fx.Graph, params: set[str], refuse_params: bool) -> None:
        self.graph, self.params, self.refuse_params = graph, params, refuse_params
        self.storage: dict[fx.Node, _Storage] = {}  # every tensor node -> its memory
        self.parent: dict[fx.Node, fx.Node] = {}  # a view -> the value it views
        self.born: dict[fx.Node, int] = {}  # the storage version a node's value belongs to
        self.now: dict[tuple[fx.Node, int], fx.Node] = {}  # (node, version) -> value node
        self.same: dict[fx.Node, fx.Node] = {}  # an in-place op's result -> its target
        # A view's arguments as the program wrote them (before renaming to current values).
        self.written_as: dict[fx.Node, tuple[Any, Any]] = {}
        self.doomed: list[fx.Node] = []
        self.grad = torch.is_grad_enabled()
        # The mode the graph's own fake values belong to (inside a backend the
        # tracing context may hold another one; fake tensors of two modes don't mix).
        fakes = (value_of(n) for n in graph.nodes)
        self.fake_mode = next(
            (v.fake_mode for v in fakes if isinstance(v, torch._subclasses.FakeTensor)), None
        )
        self.cursor: fx.Node | None = None

    def run(self) -> None:
        if not any(is_mutation(n) for n in self.graph.nodes):
            return  # nothing to do: leave the graph (and its node names) untouched
        self._read_copies_of_written_inputs()
        for node in list(self.graph.nodes):
            self.cursor = node
            if node.op == "output":
                written = self._epilogue(node)
                node.args = fx.node.map_arg(node.args, lambda a, w=written: self._returned(a, w))
            elif node.op == "placeholder":
                self._track(node, None)
            elif node.op in ("call_function", "call_method"):
                self._call(node)
        for node in reversed(self.doomed):
            self.graph.erase_node(node)

    def _read_copies_of_written_inputs(self) -> None:
        """The graph reads a copy of each input it writes into; the input gets the final value.

        Why a copy: autograd may have saved the input for the backward (``silu``
        saves its input), and the final ``copy_`` into it would then invalidate
        that saved value ("modified by an inplace operation"). Reading a clone
        leaves the saved values alone; the caller's tensor still ends with the
        written value and its autograd history, as the in-place program gives.
        """
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.input_of: dict[fx.Node, fx.Node] = {}
        for i in written_inputs(self.graph):
            ph = placeholders[i]
            with self.graph.inserting_after(placeholders[-1]):
                copy = self.graph.call_method("clone", (ph,))
            ph.replace_all_uses_with(copy, delete_user_cb=lambda user, c=copy: user is not c)
            copy.meta["example_value"] = value_of(ph)  # its memory stands for the input's
            self.input_of[copy] = ph

    # -- bookkeeping -------------------------------------------------------

    def _track(self, node: fx.Node, view_of: fx.Node | None) -> None:
        key = _storage_key(node)
        if key is None or (view_of is None and isinstance(value_of(node), (tuple, list))):
            return  # a tuple that views nothing: each element is tracked as it is taken
        if view_of is not None:
            st = self.storage[view_of]
            self.parent[node] = view_of
        else:
            st = _Storage(node, node)
        self.storage[node] = st
        self.born[node] = st.version
        self.now[(node, st.version)] = node

    def current(self, arg: Any) -> Any:
        """The node holding ``arg``'s value at this point of the program."""
        if not isinstance(arg, fx.Node) or arg not in self.storage:
            return arg
        arg = self.same.get(arg, arg)
        st = self.storage[arg]
        key = (arg, st.version)
        if key not in self.now:
            if arg is st.root:
                self.now[key] = st.base
            else:
                self.now[key] = self._replay(arg, self.current(self.parent[arg]))
        return self.now[key]

    def _replay(self, view: fx.Node, new_input: fx.Node) -> fx.Node:
        """``view``'s op again, on the new value of what it views."""
        old = self.parent[view]
        args, kwargs = self.written_as[view]

        def swap(a: Any) -> Any:
            return new_input if self.same.get(a, a) is old else self.current(a)

        args, kwargs = fx.node.map_arg(args, swap), fx.node.map_arg(kwargs, swap)
        return self._emit(view.op, view.target, args, kwargs, like=view)

    def _emit(self, op: str, target: Any, args: Any, kwargs: Any, like: fx.Node) -> fx.Node:
        assert self.cursor is not None
        with self.graph.inserting_before(self.cursor):
            node = self.graph.create_node(op, target, tuple(args), dict(kwargs))
        for key in (
            "nn_module_stack",
            "stack_trace",
            "source_fn_stack",
            "recompute",
            "ac_graph_id",
        ):
            if key in like.meta:
                node.meta[key] = like.meta[key]
        node.meta["example_value"] = self._fake(node)
        return node

    def _fake(self, node: fx.Node) -> Any:
        args = fx.node.map_arg(node.args, value_of)
        kwargs = fx.node.map_arg(node.kwargs, value_of)
        with self.fake_mode, torch.set_grad_enabled(self.grad):
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
            return node.target(*args, **kwargs)

    # -- nodes -------------------------------------------------------------

    def _call(self, node: fx.Node) -> None:
        if node in self.input_of:  # the copy of a written input: the root of its memory
            return self._track(node, None)
        if node.target is torch._C._set_grad_enabled:
            self.grad = bool(node.args[0])
        if "out" in node.kwargs:
            raise MutationError(
                f"{_where(node)}: an op with out= writes into a tensor; "
                "assign its result instead (y = op(...))"
            )
        target = _mutated_arg(node)
        if target is None:
            viewed = _viewed_input(node)  # read before the inputs are renamed
            if viewed is not None and self.same.get(viewed, viewed) not in self.storage:
                viewed = None  # an element of a multi-output op (a HOP's results): its own memory
            if viewed is not None:  # what a replay of this view starts from
                self.written_as[node] = (node.args, node.kwargs)
            node.args = fx.node.map_arg(node.args, self.current)
            node.kwargs = fx.node.map_arg(node.kwargs, self.current)
            self._track(node, None if viewed is None else self.same.get(viewed, viewed))
            return
        if target not in self.storage:
            raise MutationError(
                f"{_where(node)}: writes into a value whose memory the "
                "graph does not show (no fake tensor); compute it out of place"
            )
        self._mutation(node, target)

    def _mutation(self, node: fx.Node, target: fx.Node) -> None:
        target = self.same.get(target, target)
        st = self.storage[target]
        root = st.root
        written = self.input_of.get(root, root)
        if written.op == "placeholder" and written.name in self.params and self.refuse_params:
            raise MutationError(
                f"{_where(node)}: writes into a parameter during the forward; a "
                "parallelized parameter is a shard on each rank. Change parameters "
                "outside the model's forward (e.g. under torch.no_grad() before the call)"
            )
        old = self.current(target)
        new = self._out_of_place(node, target, old)
        if value_of(new).dtype != value_of(old).dtype:  # in-place ops keep the target's dtype
            new = self._emit("call_method", "to", (new, value_of(old).dtype), {}, like=node)
        written = {target: new}
        view, value = target, new
        while view is not root:  # write the new value back through the view chain
            view, value = self._write_back(view, value)
            written[view] = value
        st.version += 1
        st.base = value
        for n, v in written.items():
            self.now[(n, st.version)] = v
        self.storage[node] = st
        self.same[node] = target
        self.doomed.append(node)

    def _out_of_place(self, node: fx.Node, target: fx.Node, old: fx.Node) -> fx.Node:
        args = list(fx.node.map_arg(node.args, self.current))
        args[0] = old
        kwargs = fx.node.map_arg(node.kwargs, self.current)
        t = node.target
        if node.op == "call_method":
            name = str(t)
            if name in _RANDOM:
                raise MutationError(
                    f"{_where(node)}: an in-place random fill ({name}) of an "
                    "activation; draw it out of place (torch.rand_like, ...)"
                )
            if name == "zero_":
                return self._emit("call_function", torch.zeros_like, (old,), {}, like=node)
            if name == "fill_":
                return self._emit("call_function", torch.full_like, (old, args[1]), {}, like=node)
            if name == "copy_":
                return self._copy(node, old, args[1])
            functional = _functional_method(name)
            if functional is None:
                raise MutationError(
                    f"{_where(node)}: in-place method {name!r} has no "
                    "out-of-place form to rewrite it into"
                )
            return self._emit("call_method", functional, args, kwargs, like=node)
        if t in _INPLACE_OPERATOR:
            return self._emit("call_function", _INPLACE_OPERATOR[t], args, kwargs, like=node)
        if t is operator.setitem:
            return self._setitem(node, old, args[1], args[2])
        if _inplace_flag(node):
            bound = _bind(node)
            bound.arguments["inplace"] = False
            bound.arguments[next(iter(bound.arguments))] = old
            bound_args = fx.node.map_arg(tuple(bound.args), self.current)
            bound_kwargs = fx.node.map_arg(dict(bound.kwargs), self.current)
            return self._emit("call_function", t, bound_args, bound_kwargs, like=node)
        fn = getattr(torch, t.__name__[:-1])  # torch.relu_ -> torch.relu
        return self._emit("call_function", fn, args, kwargs, like=node)

    def _copy(self, node: fx.Node, old: fx.Node, src: Any) -> fx.Node:
        """``old.copy_(src)``: ``src`` broadcast to ``old``'s shape, in its dtype."""
        if isinstance(src, fx.Node) and shape_of(src) == shape_of(old):
            return self._emit("call_function", torch.clone, (src,), {}, like=node)
        return self._setitem(node, old, None, src)

    def _setitem(self, node: fx.Node, old: fx.Node, index: Any, value: Any) -> fx.Node:
        """The new value of ``old`` after ``old[index] = value`` (``index=None``: all of it)."""
        if _tensor_index(index):  # old[idx] = v, idx integer or mask tensors: index_put
            return self._index_put(node, old, index, value)
        if index is not None and not _basic_index(index):
            raise MutationError(
                f"{_where(node)}: assignment through an advanced index "
                f"({index!r}); write it out of place, e.g. with torch.where"
            )
        region = (
            old
            if index is None
            else self._emit("call_function", operator.getitem, (old, index), {}, like=node)
        )
        if isinstance(value, fx.Node):
            mask = self._emit(
                "call_function", torch.ones_like, (region,), {"dtype": torch.bool}, like=node
            )
            fill = self._emit("call_function", torch.where, (mask, value, region), {}, like=node)
        else:
            fill = self._emit("call_function", torch.full_like, (region, value), {}, like=node)
        if value_of(fill).dtype != value_of(region).dtype:  # assignment casts to the target's
            fill = self._emit("call_method", "to", (fill, value_of(region).dtype), {}, like=node)
        if index is None:
            return fill
        return self._scatter_index(node, old, fill, index)

    def _index_put(self, node: fx.Node, old: fx.Node, index: Any, value: Any) -> fx.Node:
        """``old[idx] = value`` with index tensors only: ``torch.index_put``, functional."""
        indices = tuple(index) if isinstance(index, (tuple, list)) else (index,)
        dtype = value_of(old).dtype
        if not isinstance(value, fx.Node):
            value = self._emit(
                "call_function", torch.scalar_tensor, (value,),
                {"dtype": dtype, "device": value_of(old).device}, like=node,
            )  # fmt: skip
        elif value_of(value).dtype != dtype:
            value = self._emit("call_method", "to", (value, dtype), {}, like=node)
        return self._emit("call_function", torch.index_put, (old, indices, value), {}, like=node)

    # -- writing a view's new value back into what it views ----------------

    def _write_back(self, view: fx.Node, value: fx.Node) -> tuple[fx.Node, fx.Node]:
        """(the viewed node, its new value) for ``view`` having taken ``value``."""
        src = self.parent[view]
        if src in self.parent and isinstance(value_of(src), (tuple, list)):
            return self._write_back_piece(view, src, value)
        old = self.current(src)
        op, t, args = view.op, view.target, view.args
        if t is operator.getitem:
            return src, self._scatter_index(view, old, value, args[1])
        if t in _IDENTITY_VIEWS:  # returned its input itself (same dtype and layout)
            return src, value
        if t in _SELF_INVERSE or (t is getattr and args[1] in ("T", "mT")):
            return src, self._emit(op, t, (value, *args[1:]), view.kwargs, like=view)
        if t == "permute":
            dims = args[1] if isinstance(args[1], (tuple, list)) else args[1:]
            inverse = sorted(range(len(dims)), key=lambda i: dims[i] % len(dims))
            return src, self._emit("call_method", "permute", (value, *inverse), {}, like=view)
        if t == "movedim" and len(args) == 3:
            return src, self._emit(
                "call_method", "movedim", (value, args[2], args[1]), {}, like=view
            )
        if t in _RESHAPES:
            shape = shape_of(src)
            if shape is None or not all(isinstance(s, int) for s in shape):
                raise MutationError(
                    f"{_where(view)}: a write through a reshape with symbolic "
                    "sizes; mutate the tensor before reshaping it"
                )
            return src, self._emit("call_method", "reshape", (value, *shape), {}, like=view)
        if t in ("narrow", torch.narrow):
            dim, start, length = args[1], args[2], args[3]
            return src, self._emit(
                "call_function",
                torch.slice_scatter,
                (old, value),
                {"dim": dim, "start": start, "end": start + length},
                like=view,
            )
        if t in ("select", torch.select):
            return src, self._emit(
                "call_function", torch.select_scatter, (old, value, args[1], args[2]), {}, like=view
            )
        raise MutationError(
            f"{_where(view)}: a later in-place op writes through this view "
            f"({_op(view)}), which has no exact write-back; mutate the base "
            "tensor, or take a copy (.clone()) before writing"
        )

    def _write_back_piece(self, item: fx.Node, pieces: fx.Node, value: fx.Node):
        """Piece ``i`` of ``split``/``chunk``/``unbind``: a slice (or index) of the source."""
        src = self.parent[pieces]
        old = self.current(src)
        i = item.args[1]
        nd = len(shape_of(src))
        if pieces.target in ("unbind", torch.unbind):
            dim = pieces.kwargs.get("dim", pieces.args[1] if len(pieces.args) > 1 else 0)
            return src, self._emit(
                "call_function", torch.select_scatter, (old, value, dim % nd, i), {}, like=item
            )
        dim = pieces.kwargs.get("dim", pieces.args[2] if len(pieces.args) > 2 else 0) % nd
        sizes = [t.shape[dim] for t in value_of(pieces)]
        if pieces.target not in ("split", "chunk", torch.split, torch.chunk) or not all(
            isinstance(s, int) for s in sizes
        ):
            raise MutationError(
                f"{_where(item)}: a write into a piece of {_op(pieces)}; "
                "mutate the source tensor instead"
            )
        start = sum(sizes[:i])
        return src, self._emit(
            "call_function",
            torch.slice_scatter,
            (old, value),
            {"dim": dim, "start": start, "end": start + sizes[i]},
            like=item,
        )

    def _scatter_index(self, node: fx.Node, old: fx.Node, value: fx.Node, index: Any) -> fx.Node:
        """``old`` with ``old[index]`` replaced by ``value`` (basic indexing only)."""
        steps = _index_steps(index, len(shape_of(old)))
        if steps is None:
            raise MutationError(
                f"{_where(node)}: a write through an advanced index "
                f"({index!r}); write it out of place, e.g. with torch.where"
            )
        views = [old]
        for dim, entry in steps[:-1]:  # the views from old down to the written region
            views.append(
                self._emit(
                    "call_function",
                    operator.getitem,
                    (views[-1], (slice(None),) * dim + (entry,)),
                    {},
                    like=node,
                )
            )
        for (dim, entry), base in zip(reversed(steps), reversed(views), strict=True):
            if isinstance(entry, int):
                value = self._emit(
                    "call_function", torch.select_scatter, (base, value, dim, entry), {}, like=node
                )
            else:
                value = self._emit("call_function", torch.slice_scatter, (base, value), {
                    "dim": dim, "start": entry.start, "end": entry.stop,
                    "step": 1 if entry.step is None else entry.step}, like=node)  # fmt: skip
        return value

    def _epilogue(self, output: fx.Node) -> dict[int, fx.Node]:
        """Mutated graph inputs get their final value back: one ``copy_`` each.

        Returns the ``copy_`` node of each written input's memory (by storage id).
        """
        roots = {
            id(st): st for st in self.storage.values() if st.version and st.root in self.input_of
        }
        copies: dict[int, fx.Node] = {}
        for key, st in roots.items():
            target = self.input_of[st.root]
            with self.graph.inserting_before(output):
                copy = self.graph.call_method("copy_", (target, st.base))
            copy.meta["example_value"] = value_of(target)
            copy.meta["boost_input_write"] = True
            copies[key] = copy
        return copies

    def _returned(self, arg: Any, copies: dict[int, fx.Node]) -> Any:
        """What the graph returns for ``arg``: its current value, and its aliasing.

        An output that is (a view of) a written input must still be that input's
        memory: the caller's code after the graph (the rest of a frame split by a
        graph break) may write through one name and read through the other, e.g.
        ``y = F.silu(h, inplace=True)`` returned, then ``y += h`` doubles ``h``
        too. So it is the input after its ``copy_``, with the views replayed on it,
        never the fresh value the rewrite computed.
        """
        if not isinstance(arg, fx.Node) or arg not in self.storage:
            return self.current(arg)
        node = self.same.get(arg, arg)
        st = self.storage[node]
        if st.root not in self.input_of:
            return self.current(arg)
        chain = [node]
        while chain[-1] is not st.root:
            chain.append(self.parent[chain[-1]])
        value = copies.get(id(st), self.input_of[st.root])
        for view in reversed(chain[:-1]):
            value = self._replay(view, value)
        return value
