"""The per-sample engine's front door: which route gives each tracked parameter its exact
per-sample gradients, decided here for the cockpit and the collector alike.

Routes, cheapest first:

* module-local: the calls the :class:`~.capture.Capture` recorded, by the module's rule or a
  replay of the one call (:mod:`.capture`, :mod:`.rules`, :mod:`.generic`);
* the whole graph: one batched backward pass of every sample's own loss, a chunk of samples at
  a time (:func:`.generic.whole_graph_grads`), for what no call gives exactly.

A module-local route is exact when the call's output gradient holds each sample's own gradient
and the parameter is used inside its module's calls only. Both are checked on the first step,
and again whenever a call of a module not checked before appears:

* the proof that each call tells its samples apart (:func:`.capture.mixed_calls`: calls upstream
  of a batch norm in training mode, or shared by every sample, fail it);
* the sum check: each parameter's per-sample gradients add up to its gradient, within what
  rounding explains (a sum of terms whose absolute values add up to ``s`` is exact to a few
  ``eps * s``: a gradient that is zero in exact arithmetic passes).

Where every sample's own loss is at hand, a parameter that fails a check takes the whole graph
(the engine warns once, naming it and why; :meth:`Engine.routes` reports every parameter's
route); without them a failed check is an error that names the parameter and the cause.

The forms are those of the caller's own backward pass, on the checks' step too: the checks'
pass keeps sums, not forms (:class:`_SumsOnTheWay`). Where no check follows that pass, a
parameter's form may be taken as soon as its gradient is final in it (:meth:`Engine.take`), so
that its calls' output gradients are not held to the pass's end.
"""

import contextlib
import math
import warnings
import weakref

import torch

from cockpit_fast.per_sample import routed, shared
from cockpit_fast.per_sample.capture import Capture, fingerprint, in_graph, least_precise, mixed_calls, outside_autocast, own_pass
from cockpit_fast.per_sample.generic import graph_nodes, refuse_composable_checkpoints, refuse_reentrant_checkpoints, whole_graph_grads
from cockpit_fast.per_sample.grads import HookedGrads, ScaledGrads

SUM_CHECK_SLACK = 16
"""The sum check allows ``SUM_CHECK_SLACK * eps * s``: ``s`` the absolute values of the terms
summed, ``eps`` the machine epsilon of the less precise of the two sums' dtypes (:func:`adds_up`)."""


ANOTHER_LOSS = 0.05
"""How far (relative, in norm) the first step's gradient may be from its samples' gradients' sum
before :meth:`Engine.end` says that the backward pass ran on another loss."""


class Engine:
    """Per-sample gradients of ``params``, by the cheapest exact route for each.

    Args:
        params (list[torch.Tensor]): The tracked parameters. Its capture watches module calls
            from now on.
        unsharded (cockpit_fast.fsdp.Unsharded, optional): The tensors FSDP2 computes them
            with, where it shards them (by default found by the capture).
    """

    def __init__(self, params, unsharded=None):
        self.params = list(params)
        if torch._functorch.config.donated_buffer:
            # The engine's own backward passes keep the graph, which a backward compiled with
            # donated buffers refuses: compile without them, and again what was compiled with.
            torch._functorch.config.donated_buffer = False
            torch._dynamo.reset()
        self.capture = Capture(self.params, unsharded)
        self._checked = weakref.WeakSet()  # modules whose calls took the checks
        self._checked_mixing = weakref.WeakSet()  # modules that mixed their samples when the checks ran
        self._mixed = weakref.WeakSet()  # modules whose calls do not tell their samples apart
        self._shared = weakref.WeakSet()  # modules called once for every sample, told apart where broadcast
        self._grouped = weakref.WeakSet()  # shared modules proven broadcast to rows that are k of each sample's
        self._guessed = weakref.WeakSet()  # modules whose rows the proof showed sample-major (routed.regroup)
        self._whole_only = {}  # id(param) -> why it always takes the whole graph (found by the first checks)
        self._unused = set()  # ids of parameters the checks' backward pass did not reach
        self._routes = {}  # id(param) -> its route at the last step
        self._warned = set()
        self._guesses_said = set()  # ids of the parameters whose layout guesses were warned of
        self._resumed = False  # watching again since the last pass: the forward pass under way may be unseen

    @property
    def watching(self):
        """Whether the capture records the forward passes' module calls."""
        return self.capture.watching

    def watch(self, on):
        """Record the forward passes' module calls from now on, or stop while no backward pass
        will want per-sample gradients (forward passes then cost nothing more)."""
        self._resumed = self._resumed or (on and not self.capture.watching)
        self.capture.watch(on)

    def begin(self, losses, scale, batch_size=None, loss=None, calls=None):
        """Before the backward pass whose per-sample gradients are wanted: checks the calls not
        checked before and forms what takes the whole graph, while the graph is whole.

        Args:
            losses (torch.Tensor, optional): Every sample's own loss, ``(N,)`` or ``(N, 1)``,
                with its graph; None where the caller has none (module-local routes only).
            scale (float): The backward pass's weight of each sample's loss (``1 / N`` for a
                mean loss): the forms are in its units.
            batch_size (int, optional): N as the caller knows it; by default the losses'.
            loss (torch.Tensor, optional): Where the backward pass starts, checked for what no
                per-sample route sees into (where there are no ``losses`` to check).
            calls (list, optional): :meth:`calls_of` the losses and loss, where the caller has
                read them already (the graph is not read again).

        Returns:
            _Pass: to hand to :meth:`end` after the backward pass.
        """
        with outside_autocast(self.params):
            return self._begin(losses, scale, batch_size, loss, calls)

    def _begin(self, losses, scale, batch_size, loss, calls):
        losses = _sample_losses(losses)
        if losses is not None:
            batch_size = losses.shape[0] if batch_size is None else batch_size
        tracked = [p for p in self.params if p.requires_grad]
        start = _pass_start(losses, loss)
        root = None if start is None else start.grad_fn
        calls = self.calls_of(losses, loss) if calls is None else calls
        changed = [call for call in calls if call.changed_in_place()]
        if changed and losses is not None:
            # Calls of an earlier forward pass whose graph the user keeps (a loss summed without
            # detach) are no part of this one: their inputs may since hold another batch. (Not
            # told for a call whose changed view is gone from the graph. Without the losses, a
            # changed call that the backward pass reaches is refused after it: end().)
            unsure = [call for call in changed if not call.hooked_views]
            gone = set(unsure) - set(in_graph(root, unsure))
            calls = [call for call in calls if call not in gone]
        # Checked again: after a module was set up otherwise (capture.module_setup: pruned, hooked),
        # and where a batch norm put in training mode since the checks mixes the samples upstream.
        unchecked = (
            any(call.module not in self._checked for call in calls)
            or self.capture.set_up_otherwise
            or any(module not in self._checked_mixing for module in self.capture.mixing)
        )
        if batch_size is not None:  # rows that are not the samples: each row's sample, this step's routing
            # Rows taken sample-major where the graph does not tell: on steps that prove it, or as proven.
            proven = lambda call: losses is not None and (unchecked or call.module in self._guessed)  # noqa: E731
            routed.regroup(calls, batch_size, guess=proven)
        if unchecked and start is not None:
            refuse_reentrant_checkpoints(start)
        step = _Pass()
        step.calls = calls
        try:
            shared = [call for call in calls if call.module in self._shared and not call.shared]
            # (k rows of each sample where the proof runs, or where it ran with such rows: one row each proves no grouping)
            grouped = lambda call: (unchecked and losses is not None) or call.module in self._grouped  # noqa: E731
            self._mixed.update(call.module for call in self._share(shared, root, batch_size, step.handles, grouped))
            checks = losses is not None and unchecked and losses.shape[0] > 0
            whole = {} if checks else self._whole_graph_needs(calls, tracked, batch_size, losses is not None, root)
            if checks or whole:
                refuse_composable_checkpoints(self.capture.root)
            own_passes = self.capture.unsharded.engine_passes(checks or bool(whole))
            # (Every rank hands in its losses, or none does: then none runs a pass of its own.)
            with own_passes if losses is not None else contextlib.nullcontext():
                if checks:
                    whole, step.sums = self._checks(losses, tracked, scale, calls, batch_size, step.handles)
                step.forms = self._whole_graph(losses, tracked, whole, scale, calls)
                if checks:
                    step.sums.update(_sums_of(step.forms))
        except BaseException:
            step.release()
            raise
        self.capture.arm()
        step.check = unchecked and not checks
        step.checking = unchecked
        step.streams = not step.check and not self.capture.unsharded.active and not any(call.changed for call in calls)
        return step

    def calls_of(self, losses=None, loss=None):
        """The module calls of the forward pass a backward pass runs through, from the samples'
        ``losses`` or else the ``loss`` (neither: unknown yet): the calls whose graph is alive,
        less those of another forward pass whose graph the user keeps (a validation pass with
        gradients on, its loss kept for logging), where their sizes show that another pass is
        alive (the graph is read then only)."""
        calls = self.capture.calls()
        start = _pass_start(losses, loss)
        root = None if start is None else start.grad_fn
        if root is None or len({call.batch_size for call in calls if not call.shared}) <= 1:
            return calls
        return in_graph(root, calls)

    def take(self, step, param, unscale=1.0):
        """During the backward pass of ``step``, once ``param``'s gradient in it is final: its
        form, for statistics computed while the pass runs, which :meth:`end` then leaves out
        (its calls' output gradients need not be kept to the end). None where it waits for
        end(): a pass whose sums are checked after it, or a form that is not a rule's alone
        (:meth:`.capture.Capture.take`).

        Args:
            unscale (float): As for :meth:`end`.
        """
        if not step.streams or id(param) in step.forms:
            return None
        with outside_autocast([param]):  # (a backward pass run inside autocast: the forms are not its)
            form = self.capture.take(id(param))
        if form is None:
            return None
        step.taken.add(id(param))
        return form if unscale == 1.0 else ScaledGrads(form, unscale)

    def end(self, step, grads=None, failed=False, unscale=1.0):
        """After the backward pass: ``{id(param): form}`` of every tracked parameter it reached.

        Args:
            step (_Pass): What :meth:`begin` returned.
            grads (dict, optional): ``id(param)`` -> the gradient the backward pass gave: the
                parameters it did not reach get no form, and where :meth:`begin` could not check
                (no individual losses) the sums are checked against it.
            failed (bool): The backward pass raised: only disarm.
            unscale (float): What the backward pass's gradients are multiplied by to be in the
                units of the losses (``1 / scale`` of a ``GradScaler``); ``grads`` are already.
        """
        with outside_autocast(self.params):
            return self._end(step, grads, failed, unscale)

    def _end(self, step, grads, failed, unscale):
        step.release()
        if not failed:  # the next step's forward pass is another (a graph the user keeps is no part of it)
            for call in step.calls:
                call.spend()
            self._resumed = False
        if step.sums and grads:
            self._warn_if_another_loss(step.sums, grads)
        found, fired = self.capture.disarm(skip=step.forms, forms=not failed)
        if failed:
            return {}
        spoiled = {call: [p for p in call.params.values() if id(p) not in step.forms] for call, _ in fired if call.changed}
        spoiled = {call: params for call, params in spoiled.items() if params}
        if spoiled:
            call, params = next(iter(spoiled.items()))
            raise ValueError(
                f"the per-sample gradients of {self._describe([id(p) for p in params])} cannot be formed: their module "
                f"{type(call.module).__name__}: {call.changed}. Hand in info['individual_losses'] with their graph (they "
                "then take the whole graph), or change no such tensor in place before the backward pass"
            )
        if grads is not None:
            # A call's parameters that its backward pass did not reach (a submodule it never ran,
            # such as a decoder's cross-attention without an encoder) have no per-sample gradients.
            found = {key: form for key, form in found.items() if key in grads}
        if unscale != 1.0:
            found = {key: ScaledGrads(form, unscale) for key, form in found.items()}
        if step.check:
            wrong = self._sums_wrong(_sums_of(found), grads or {})
            if wrong:
                raise ValueError(
                    f"the per-sample gradients of {self._describe(wrong)} do not add up to their gradient: "
                    "they are used outside the forward pass of the module that owns them (a functional use in "
                    "another module's forward, say). Hand in info['individual_losses'] with their graph (they "
                    "then take the exact route through the whole graph), or track without them"
                )
            # (A guess is neither learnt nor checked: the next step with individual losses proves it.)
            unguessed = [call for call, _ in fired if not call.layout_guessed]
            self._warn_of_guesses([call for call, _ in fired if call.layout_guessed], {*found, *step.taken})
            self._learn_layouts(unguessed)
            self._checked.update(call.module for call in unguessed)
            self.capture.set_up_otherwise = False
        if step.checking and grads and step.users_hooks:
            self._warn_if_hooks_not_linear(found, grads)
        # A parameter the whole graph found unused (read in training only, say) gets no form either.
        whole = step.forms if grads is None else {key: form for key, form in step.forms.items() if key in grads}
        self._record_routes(fired, whole, {**found, **dict.fromkeys(step.taken)})
        return {**found, **whole}

    def per_sample(self, losses, scale=1.0, retain_graph=True):
        """``{id(param): form}`` of every sample's own loss, from a backward pass of its own
        (the collector's route); ``retain_graph``: whether the graph survives it."""
        losses = _sample_losses(losses)
        with self.capture.unsharded.engine_passes(True, frees_the_graph=not retain_graph, on_every_rank=True):
            step = self.begin(losses, scale)
            step.users_hooks = False
            tracked = [p for p in self.params if p.requires_grad]
            inputs = self._in_graph(tracked)
            try:
                with user_hooks_set_aside(inputs), own_pass(self.capture), self._no_nested_backward(tracked, inputs):
                    grads = torch.autograd.grad(
                        losses, inputs, torch.full_like(losses, scale), retain_graph=retain_graph, allow_unused=True
                    )
            except BaseException:
                self.end(step, failed=True)
                raise
        return self.end(step, {id(p): g for p, g in zip(tracked, grads) if g is not None})

    def routes(self):
        """``{name: route}`` of every tracked parameter at the last step with per-sample gradients
        (``"not reached"`` where that step's backward pass did not reach it)."""
        names = self._names()
        return {names[id(p)]: self._routes.get(id(p), "not reached") for p in self.params}

    def _checks(self, losses, tracked, scale, calls, batch_size, handles):
        """The checks, on a backward pass of ``losses`` weighted by ``scale`` whose calls' forms
        are summed as their output gradients arrive (:class:`_SumsOnTheWay`), then one more
        weighted at random (the proof). Calls that fail as made once for every sample are
        checked again taken apart where their output is broadcast, and calls that fail with as
        many positions as samples (T == N) again time first.

        Returns:
            ``{id(param): why}`` of the parameters that take the whole graph, and
            ``{id(param): the sum of its samples' gradients}`` of the rest (the pass's own forms
            are not kept: the user's backward pass gives them, as on later steps).
        """
        weights = torch.full_like(losses, scale)
        inputs = self._in_graph(tracked)
        flipped = []
        for attempt in range(2):
            sums = _SumsOnTheWay(self.capture)
            self.capture.arm(sums.keep)  # (reading the user's hooks, applied to each sample's gradient)
            try:
                with user_hooks_set_aside(inputs), own_pass(self.capture), self._no_nested_backward(tracked, inputs):
                    # (the engine's own passes are not the user's step)
                    grads = torch.autograd.grad(losses, inputs, weights, retain_graph=True, allow_unused=True)
            finally:
                _, fired = self.capture.disarm()
            with user_hooks_set_aside(inputs):
                mixed = mixed_calls(self.capture, losses, inputs, weights, reference=fired)
            unsure = [c for c in calls if not c.shared and (c in mixed or c.batch_size != batch_size)]
            if attempt or not unsure:
                break
            self._share(unsure, losses.grad_fn, batch_size, handles)
            flipped = [call for call in unsure if call in mixed and call.may_be_time_first(batch_size)]
            for call in flipped:
                call.take_time_first()
            if not flipped and not any(call.shared for call in unsure):  # none to check again
                break
            sums = fired = grads = None  # the next pass's replace them: not both held at once
        self._learn_layouts([call for call in calls if call not in mixed])
        self._mixed.update(call.module for call in mixed)
        self._shared.update(call.module for call in calls if call.shared and call not in mixed)
        self._grouped.update(call.module for call in calls if call.rows_per_sample and call not in mixed)
        guessed = [call for call in calls if call.routed is not None and call.routed.guessed]
        self._guessed.update(call.module for call in guessed if call not in mixed)
        self._checked.update(call.module for call in calls)
        self.capture.set_up_otherwise = False
        self._checked_mixing.update(self.capture.mixing)
        self._unused = {id(p) for p, g in zip(tracked, grads) if g is None}
        whole = self._whole_graph_needs(calls, tracked, batch_size, True, losses.grad_fn)
        sums.formed_after(skip=whole)
        given = {id(p): g for p, g in zip(tracked, grads) if g is not None}
        checked = {key: entry for key, entry in sums.sums.items() if key in given and key not in whole}
        for key in self._sums_wrong(checked, given):
            self._whole_only[key] = (
                "its per-sample gradients do not add up to its gradient: it is used outside its module's forward pass "
                "(a functional use elsewhere), or an output of its module is changed in place where no hook follows it"
            )
            whole[key] = self._whole_only[key]
        for key, error in sums.unreplayable.items():
            self._whole_only[key] = f"its call cannot be replayed sample by sample ({error})"
            whole[key] = self._whole_only[key]
        for key in given.keys() - sums.found - whole.keys():
            self._whole_only[key] = (
                "the gradient of its module's output never reached the hook on it (an output changed in place where "
                "no hook follows it)"
            )
            whole[key] = self._whole_only[key]
        return whole, {key: entry for key, entry in checked.items() if key not in whole}

    def _learn_layouts(self, proven):
        """Remember where the ``proven`` calls (by the proof, or where it did not run by their
        sizes, not guessed) were found to hold their samples, for later calls of their modules
        whose sizes cannot tell (:attr:`Capture.layouts`)."""
        for call in proven:
            if call.layout_found:
                known = self.capture.layouts.get(call.module, frozenset())
                self.capture.layouts[call.module] = known | {call.sample_dim}

    def _share(self, calls, root, batch_size, handles, grouped=lambda call: True):
        """Takes apart ``calls`` made once for every sample where their output is broadcast
        (:mod:`.shared`; to rows that are k of each sample's where ``grouped(call)``), adding the
        hooks to ``handles``; returns those in this backward pass's graph that cannot be (calls
        of an earlier graph the user keeps are no part of it)."""
        if not calls or root is None or batch_size is None:
            return calls
        for call in calls:
            if call.routed is not None and call.routed.guessed:  # its rows were no samples: one call for them all?
                routed.ungroup(call)
        found = shared.frontiers(root, calls, batch_size, grouped)
        for call, adds in found.items():
            if adds is not None:
                call.share(batch_size, shared.rows_per_sample(adds, batch_size))
                handles.extend(shared.install(adds, call, self.capture))
        return [call for call, adds in found.items() if adds is None]

    def _whole_graph_needs(self, calls, tracked, batch_size, has_losses, root):
        """``{id(param): why}`` of the parameters no module call gives exactly; ``root``: where
        the backward pass starts (a parameter no call covers that its graph does not reach is
        unused, not one for the whole graph: a head the step skips)."""
        needs, covered = {}, set()
        for call in calls:
            ids = {id(p) for p in call.params.values()}
            covered |= ids
            why = None
            if batch_size is not None and call.batch_size != batch_size:
                why = f"its calls of {type(call.module).__name__} do not hold the batch's samples along their sample dimension"
            elif call.module in self._mixed:
                why = (
                    f"the samples of its calls of {type(call.module).__name__} cannot be told apart (upstream of "
                    "modules whose samples interact, or one call shared by every sample)"
                )
            elif call.outputs_entangled:
                why = f"its module {type(call.module).__name__} {call.outputs_entangled}"
            elif call.changed and has_losses:
                why = f"its module {type(call.module).__name__}: {call.changed}"
            elif call.layout_unknown:
                why = (
                    f"its module {type(call.module).__name__} was called with its samples along dimension 0 and "
                    "along 1, and this call holds as many positions as samples (sizes cannot tell which)"
                )
            elif call.replays_randomness():
                why = f"its module {type(call.module).__name__} draws random numbers (dropout) and cannot be replayed"
            if why is not None:
                needs.update(dict.fromkeys(ids, why))
        # No call covers them, nor are they known unused (per_param() tells of those), nor does
        # the graph leave them out.
        uncovered = [p for p in tracked if id(p) not in covered and id(p) not in self._unused and id(p) not in self._whole_only]
        orphans = {id(p) for p in uncovered}
        if root is not None and uncovered:
            orphans &= self._reached_from(root, uncovered)
        for p in tracked:
            if id(p) in self._whole_only:
                needs.setdefault(id(p), self._whole_only[id(p)])
            elif id(p) in orphans and (has_losses or self._resumed):
                why = (
                    "its forward pass ran while the cockpit was not watching (after a step no quantity tracks, "
                    "the cockpit watches again for the step numbered one more, or one it is told of with "
                    "cockpit.expect(step))" if self._resumed else
                    "its calls were gone through by an earlier tracked backward pass (per-sample gradients "
                    "taken again from one graph)" if self._gone_through(p) else
                    "no module call computed with it (used before the cockpit was made, or handed out as it is by its "
                    "module's forward?)"
                )
                needs.setdefault(id(p), why)
        if self.capture.mixing and not has_losses:
            names = ", ".join(sorted({type(m).__name__ for m in self.capture.mixing}))
            raise ValueError(
                f"per-sample gradients where samples interact ({names} in training mode) need every sample's own "
                "loss: hand in info['individual_losses'] with their graph (computed from the model's output, not "
                "detached)"
            )
        if needs and not has_losses:
            raise ValueError(
                f"per-sample gradients of {self._describe(needs)} need every sample's own loss "
                f"({next(iter(needs.values()))}): hand in info['individual_losses'] with their graph (computed "
                "from the model's output, not detached)"
            )
        return needs

    def _whole_graph(self, losses, tracked, needs, scale, calls):
        """The whole-graph forms of the parameters in ``needs``, saying once why they take it;
        ``calls``, the forward pass's, tell the size of its activations."""
        if not needs:
            return {}
        self._warn_once(needs)
        params = [p for p in tracked if id(p) in needs]
        inputs = self._in_graph(params)
        activations = sum(math.prod(shape) for call in calls for shape in call.output_shapes)
        with own_pass(self.capture), self._no_nested_backward(params, inputs):
            forms = whole_graph_grads(losses, inputs, scale, activations)
        return {id(p): forms[id(g)] for p, g in zip(params, inputs)}

    def _reached_from(self, root, params):
        """Ids of those of ``params`` whose gradient the graph of ``root`` (a backward node)
        accumulates."""
        wanted, found = {id(t): id(p) for t, p in zip(self._in_graph(params), params)}, set()
        for node in graph_nodes(root):
            if len(found) == len(wanted):
                break
            variable = getattr(node, "variable", None)  # (an AccumulateGrad's leaf)
            if variable is not None and id(variable) in wanted:
                found.add(wanted[id(variable)])
        return found

    def _in_graph(self, params):
        """The tensors the graph holds for ``params`` (under FSDP2 the unsharded ones)."""
        return [self.capture.unsharded.in_graph(p) for p in params]

    def _sums_wrong(self, sums, grads):
        """Ids of the parameters whose samples' gradients do not add up to ``grads`` (``id ->
        gradient``); ``sums``: ``id -> (their sum, magnitude, dtypes computed in)``."""
        sums = {key: entry for key, entry in sums.items() if key in grads}
        floor = max((float(m.nan_to_num(0.0).max()) for _, m, _ in sums.values() if m.numel()), default=0.0)
        return [key for key, (summed, m, computed_in) in sums.items() if not adds_up(summed, computed_in, grads[key].detach(), m, floor)]

    def _warn_if_another_loss(self, sums, grads):
        """The checks' sums (``id -> (sum, magnitude, dtypes computed in)``) are of each sample's
        gradient of the losses as the caller weighs them: a backward pass that ran on another
        loss (a sum where the caller said mean, a term no sample has) gives another gradient,
        which the statistics would set against each sample's. Off by more than ANOTHER_LOSS of
        its norm, over the parameters whose sums rounding does not explain: also where a model
        computes in a narrower dtype inside (Mamba's float32 scan in a float64 model: 1e-7), or
        a gradient is zero in exact arithmetic (a key projection's bias: its rounding noise).
        Parameters with the user's hooks are left out (their gradient is the hooks', not the
        losses')."""
        wrong = set(self._sums_wrong(sums, grads))
        if not wrong:
            return
        off = torch.stack([_norm(sums[key][0] - grads[key].detach()).double() for key in wrong]).norm()  # (5% needs no float64 copies)
        size = torch.stack([_norm(grads[key].detach()).double() for key in sums if key in grads]).norm()
        if bool(off > ANOTHER_LOSS * size):  # (False where either is not finite: a NaN loss is warned of elsewhere)
            warnings.warn(
                f"the backward pass's gradient is {float(off / size):.3g} of its norm away from the sum of the samples' "
                "gradients of their losses as info['loss'] (or micro_batch(loss=...)) weighs them: backward() ran on "
                "another loss (a sum where that loss is a mean, a term no sample has), and the statistics set each "
                "sample's gradient against that gradient. Run backward() on the loss handed in",
                RuntimeWarning,
            )

    def _warn_if_hooks_not_linear(self, found, grads):
        """Say once of the parameters whose hooks (``param.register_hook``) are not linear, as a
        clip is: each sample's gradient hooked (the statistics' per-sample gradients) does not
        add up to the mini-batch gradient hooked (the step's, which the statistics set them
        against)."""
        hooked = {key: found[key] for key in self.capture.hooked if key in found and key in grads}
        sums = {key: (form.grad, form.magnitude(), form.computed_in) for key, form in hooked.items()}
        wrong = self._sums_wrong(sums, grads) if sums else []
        if not wrong:
            return
        message = (
            f"cockpit_fast: the hooks on {self._describe(wrong)} are not linear (a clip, say): each sample's gradient "
            "hooked does not add up to the mini-batch gradient hooked, which the statistics set the samples' against "
            "(a gradient noise from hooked samples around another mean). Clip the mini-batch gradient after the "
            "backward pass instead (torch.nn.utils.clip_grad_value_), or track without them"
        )
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _record_routes(self, fired, whole, found):
        routes = {}
        for call, _ in fired:
            for name, p in call.params.items():
                if id(p) in found:
                    routes.setdefault(id(p), call.route_of(name))
        for key in whole:
            routes[key] = "whole graph"
        self._routes = routes

    def _gone_through(self, param):
        """Whether a call of ``param`` that a tracked backward pass went through is still alive."""
        return any(call.spent and any(p is param for p in call.params.values()) for call in self.capture.recent)

    def _warn_once(self, needs):
        by_reason, position = {}, {id(p): i for i, p in enumerate(self.params)}
        for key, why in sorted(needs.items(), key=lambda item: position.get(item[0], -1)):  # (one text for one set)
            by_reason.setdefault(why, []).append(key)
        for why, keys in by_reason.items():
            message = (
                f"cockpit_fast: {self._describe(keys)} take{'s' if len(keys) == 1 else ''} the whole-graph route "
                f"(a batched backward pass of every sample's loss, slower than a module-local rule): {why}"
            )
            if message not in self._warned:
                self._warned.add(message)
                warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _warn_of_guesses(self, calls, reached):
        """Warn once of the parameters of ``calls`` (of ids in ``reached``: the pass gave them
        forms) whose samples were taken along dimension 0 where the sums cannot tell: as many
        positions as samples (T == N), no losses to prove it."""
        guessed = {id(p) for call in calls for p in call.params.values()} & reached - self._guesses_said
        keys = [id(p) for p in self.params if id(p) in guessed]
        if keys:
            self._guesses_said.update(keys)
            warnings.warn(
                f"cockpit_fast: the calls of {self._describe(keys)} hold as many positions as samples ({calls[0].batch_size}): "
                "taken batch first, which the sum check cannot tell from time first. A module that runs time first "
                "inside (it transposes its input) gets wrong per-sample statistics so: hand in "
                "info['individual_losses'] to have the layout proven",
                RuntimeWarning,
                stacklevel=4,
            )

    @contextlib.contextmanager
    def _no_nested_backward(self, params, inputs):
        """Around the engine's own ``torch.autograd.grad`` passes (of ``inputs``, those of
        ``params`` in the graph), which write no ``.grad``: raises a ValueError where one was
        written all the same, by a backward pass run inside a backward node's. The parameters it
        reaches are in no graph the engine's passes see: theirs would be zero."""
        before = [(g.grad, None if g.grad is None else g.grad._version) for g in inputs]
        yield
        nested = [
            id(p) for p, g, (grad, version) in zip(params, inputs, before)
            if g.grad is not grad or (grad is not None and grad._version != version)
        ]
        if nested:
            raise ValueError(
                f"per-sample gradients of {self._describe(nested)} cannot be computed: their .grad was written during "
                "the engine's own backward pass, which writes none: a custom autograd.Function's backward runs a "
                "backward pass of its own that gives them their gradient (it recomputes its layers, as Reformer's "
                "reversible layers do), which a backward pass of every sample's own loss cannot see into (or a hook "
                "writes .grad: write it after the backward pass)"
            )

    def _names(self):
        """``id(param) -> name`` in the model the capture last saw, else by position."""
        root = self.capture.root
        names = {}
        if root is not None:
            for name, p in root.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), name)
        for index, p in enumerate(self.params):
            names.setdefault(id(p), f"parameter {index} (shape {tuple(p.shape)})")
        return names

    def _describe(self, keys):
        names = self._names()
        listed = [names.get(key, "?") for key in keys]
        shown = ", ".join(listed[:6]) + (f" and {len(listed) - 6} more" if len(listed) > 6 else "")
        return f"{len(listed)} tracked parameter{'s' if len(listed) != 1 else ''} ({shown})"


class _Pass:
    """What :meth:`Engine.begin` decided for one backward pass."""

    def __init__(self):
        self.forms = {}  # formed before the backward pass: the whole graph's
        self.sums = {}  # id -> (the sum of its samples' gradients, their magnitude, dtypes), where the checks ran before it
        self.check = False  # the sums are checked after it (no individual losses to check before)
        self.checking = False  # the checks run for it, before it (with the individual losses) or after it
        self.users_hooks = True  # the user's hooks on parameters run in it (not the collector's own pass)
        self.handles = []  # hooks on the graph for calls shared by every sample
        self.calls = []  # the calls of the forward pass it plans for
        self.streams = False  # take() may give forms while the backward pass runs
        self.taken = set()  # ids of the parameters whose forms take() gave

    def release(self):
        """Removes the hooks on the graph (its later backward passes are not this step's)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []


class _SumsOnTheWay:
    """The checks' pass, kept small: each call's forms summed, parameter by parameter, as its
    output gradients arrive, and each output's :func:`~.capture.fingerprint` for the proof.
    Holding the output gradients to the end of the pass, with its graph alive for the user's
    pass, would take the first step's memory far above a later step's. Calls of several outputs,
    and those whose forms replay the module (torch.func does not run inside a backward pass),
    are formed after the pass (:meth:`formed_after`); so is every call of a graph where samples
    interact (a batch norm in training mode), whose calls upstream take the whole graph: their
    sums would be computed for nothing.

    Args:
        capture (Capture): The capture armed with :meth:`keep` for the pass.
    """

    def __init__(self, capture):
        self.capture = capture
        self.sums = {}  # id(param) -> (its samples' gradients summed, their magnitude, the dtype computed in)
        self.found = set()  # ids of the parameters some call's forms cover
        self.unreplayable = {}  # id(param) -> the first line of what its call's replay raised
        self._held = {}  # call -> its output gradients, formed after the pass
        self._in_the_pass = not capture.mixing

    def keep(self, call, grad, index):
        """The capture's ``keep``: the fingerprint the pass keeps of the output gradient."""
        now = self._in_the_pass and grad is not None and len(call.output_shapes) == 1 and call.served_by_rule(call.params)
        forms = call.forms([grad]) if now else None
        if forms is not None and not call._replays:  # (a rule may decline a call: then the module is replayed)
            self._add(call, forms)
        else:
            self._held.setdefault(call, [None] * len(call.output_shapes))[index] = grad
        return fingerprint(call, grad, index)

    def formed_after(self, skip):
        """Sums of the calls held to the end of the pass, but for parameters whose ids are in
        ``skip`` (taking the whole graph already: their replays need not run)."""
        held, self._held = self._held, {}
        for call, grads in held.items():
            if call.routed is None and call.ungrouped_from is not None:  # regrouped as they came, taken back since
                grads = [call.ungrouped_from.rows_of(g) for g in grads]
            self._add(call, call.forms(grads), skip)

    def _add(self, call, forms, skip=()):
        for name, form in forms.items():
            key = id(call.params[name])
            self.found.add(key)
            if key in self.capture.hooked or key in skip or key in self.unreplayable:
                continue  # (the user's hooks change each sample's gradient: theirs are not checked)
            try:
                summed, magnitude = form.grad, form.magnitude()
            except (RuntimeError, ValueError) as error:  # a replay that cannot run, or one drawing random numbers
                self.unreplayable[key] = (str(error).splitlines() or [""])[0]
                self.sums.pop(key, None)
                continue
            if key in self.sums:
                before, scale, computed_in = self.sums[key]
                summed, magnitude = before + summed, scale + magnitude
                form_in = least_precise([computed_in, call.computed_in])
            else:
                form_in = call.computed_in
            self.sums[key] = (summed, magnitude, form_in)


def _sums_of(forms):
    """``{id: (sum, magnitude, dtype computed in)}`` of ``forms`` for the sum check, but those
    that read the user's hooks (which change each sample's gradient)."""
    return {key: (form.grad, form.magnitude(), form.computed_in) for key, form in forms.items() if not isinstance(form, HookedGrads)}


def _norm(tensor):
    """The 2-norm of ``tensor``, summed in float32 at least."""
    return torch.linalg.vector_norm(tensor, dtype=torch.promote_types(tensor.dtype, torch.float32))


def _pass_start(losses, loss):
    """Where a backward pass starts as the engine reads it: the samples' losses, else the loss
    (a tensor), else None."""
    return losses if losses is not None else loss if isinstance(loss, torch.Tensor) else None


def _sample_losses(losses):
    """``losses`` as ``(N,)`` with its graph, or None where there are none to backpropagate."""
    if losses is None or not isinstance(losses, torch.Tensor) or losses.grad_fn is None:
        return None
    return losses.reshape(-1)


def adds_up(summed, computed_in, grad, magnitude, floor=0.0):
    """Whether per-sample gradients that add up to ``summed``, computed in ``computed_in`` (a
    form's ``grad`` and ``computed_in``), add up to ``grad`` within what rounding explains,
    entry by entry: ``SUM_CHECK_SLACK`` times

    * the machine epsilon of the two sums' dtypes times the absolute values summed
      (``magnitude``, the forms' :meth:`~.grads.PerSampleGrads.magnitude`), and at least times
      ``floor``: the largest such sum in the model, for entries whose terms were summed before
      the form saw them (a bias's over positions) and cancel (a key projection's bias, zero in
      exact arithmetic, is rounding noise of the model's gradient);
    * plus, where the calls computed in a less precise dtype (autocast's), its epsilon times
      ``magnitude``: the parameter's gradient was rounded there once more.

    Entries that are not finite in both agree (a sample's NaN is its own)."""
    summed_in = least_precise([summed.dtype, grad.dtype])
    wide = torch.promote_types(torch.promote_types(summed.dtype, grad.dtype), torch.float32)
    summed, grad, magnitude = summed.to(wide), grad.to(wide), magnitude.to(wide)
    computed_in = least_precise([summed_in, computed_in])
    rounding = torch.finfo(summed_in).eps * magnitude.clamp(min=floor)
    if computed_in != summed_in:
        rounding = rounding + torch.finfo(computed_in).eps * magnitude
    tolerance = SUM_CHECK_SLACK * rounding + torch.finfo(wide).tiny
    agree = ((summed - grad).abs() <= tolerance) | (~summed.isfinite() & ~grad.isfinite())
    return bool(agree.all())


@contextlib.contextmanager
def user_hooks_set_aside(params):
    """The user's hooks on ``params`` do not run in the engine's own backward passes (they run
    once on the mini-batch gradient, and on each sample's gradient in the statistics)."""
    kept = [(p, dict(p._backward_hooks)) for p in params if p._backward_hooks]
    for p, _ in kept:
        p._backward_hooks.clear()
    try:
        yield
    finally:
        for p, hooks in kept:
            p._backward_hooks.update(hooks)
