"""sparsegen.patch: swap a model's linear layers for block-sparse ones, by name pattern, and fuse
what the kernels can take of recognised transformer blocks (epilogues.py)."""
from __future__ import annotations

import copy
import difflib
import re
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from . import warm
from .jit import epilogues, registry
from .errors import InputError, expect

# Every layout's face that takes patch rules (registry.Face: declared in its package), and the
# settings each sparsity takes in a rule (any other is refused, naming it).
FACES = {face.sparsity: face for face in registry.faces() if face.patch is not None}
RULE_SETTINGS = {sparsity: face.rule for sparsity, face in FACES.items()}
_SETTINGS = ("sparsity", *dict.fromkeys(key for keys in RULE_SETTINGS.values() for key in keys))


def patch(model: nn.Module, rules: dict, from_dense: bool = True, fuse: bool = True, strict: bool = False) -> list[str]:
    r"""Replace, in place, every linear layer whose qualified name (as in named_modules())
    matches a pattern of `rules` - the whole name or a whole dotted suffix of it, so
    r"mlp\.(gate|up|down)_proj" finds model.layers.0.mlp.gate_proj - by a BlockSparseLinear built with that pattern's
    settings ({"block": (32, 32), "density": 0.5} or {"layout": mask}), or by a
    Sparse24Linear for {"sparsity": "2:4"} (optional "method": "magnitude" or
    "transposable"; always pruned from the dense weights), or a Sparse24TrainingLinear for
    {"sparsity": "2:4", "training": {options}}, or a ScaledSparse24Linear for {"sparsity":
    "2:4", "weight_dtype": "e4m3" or "int8"} (weights quantized per output channel,
    activations per token), or the layer of any other layout's face that takes rules
    ({"sparsity": "block-diagonal", "nblocks": 4}, {"sparsity": "block-ell", "block": (64, 64),
    "per_row": 2}; RULE_SETTINGS lists each one's settings); the first matching pattern wins.
    With from_dense, the blocks of largest norm keep their pretrained values.

    With `fuse`, the kernels also take over what follows the replaced layers in recognised
    blocks: an activation after an MLP's first projection (BERT's intermediate dense, GPT-2's
    c_fc: FUSED_ACTIVATIONS) runs in its kernel's epilogue, and a gated MLP (Llama's
    down(act(gate(x)) * up(x)), gate and up under one rule) becomes a GatedMLP whose
    gate and up projections are one sparse layer with a gated epilogue (their rows
    interleaved, epilogues.interleave_rows; block layouts are then chosen over the pair).
    Returns the sparse layers' names as the model has them afterwards (a fused pair's as its
    GatedMLP's `gate_up`), a list whose `.fused` maps each such name to the projections it
    took. Every rule is checked before anything changes.

    A suffix pattern that matches one suffix in places of different roles (BERT's
    r"output\.dense" also finds attention.output.dense) warns, naming them and how to anchor
    it; with `strict=True` that is an InputError before anything changes.
    """
    expect(isinstance(rules, dict) and rules, "rules as a non-empty {pattern: settings} dict", rules)
    plan = _plan(model, rules)
    warm.warm_packing([(_face_of(settings), settings, _dense_weight(module)) for _, module, settings in plan])
    _check_roles(plan, rules, strict)
    warm.warm_cublas(model, skip={name for name, _, _ in plan})
    gated = _gated_mlps(model, plan) if fuse else []
    paired = {name for mlp in gated for name in mlp.projections}
    built = {name: _build(module, settings, from_dense, name) for name, module, settings in plan if name not in paired}
    for name, layer in built.items():
        _replace(model, name, layer)
    for mlp in gated:
        _replace(model, mlp.name, mlp.build(from_dense))
    if fuse:
        _fuse_activations(model, built)
    warm.warm([m for m in model.modules() if _is_sparse_layer(m)])
    return Patched(plan, gated)


class Patched(list):
    """What patch returns: the new layers' names as the model has them now, in the model's
    order, and `fused`: {a GatedMLP's gate_up: [the projections it took]}."""

    def __init__(self, plan: list, gated: list):
        fused = {f"{mlp.name}.gate_up": list(mlp.projections) for mlp in gated}
        taken = {name: new for new, names in fused.items() for name in names}
        super().__init__(dict.fromkeys(taken.get(name, name) for name, _, _ in plan))
        self.fused = fused


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


# (linear, activation) attribute pairs of blocks whose forward applies the activation to the
# linear's output and to nothing else: BERT-style intermediate layers (ViT, RoBERTa), GPT-2's
# and StarCoder2's MLP, CLIP/SigLIP/Phi/OPT/BART/Whisper (fc1, activation_fn), timm's Mlp
# (fc1, act), DINOv2 (fc1, activation), GPT-J and CodeGen (fc_in, act), GPT-NeoX and Falcon
# (dense_h_to_4h, act), T5 (wi, act), DistilBERT (lin1, activation).
FUSED_ACTIVATIONS = (("dense", "intermediate_act_fn"), ("c_fc", "act"), ("fc1", "activation_fn"), ("fc1", "act"),
                     ("fc1", "activation"), ("fc_in", "act"), ("dense_h_to_4h", "act"), ("wi", "act"),
                     ("lin1", "activation"))
# Activation modules by class name (torch's and transformers' ACT2FN classes).
_ACTIVATION_NAMES = {"ReLU": "relu", "SiLU": "silu", "SiLUActivation": "silu", "GELUActivation": "gelu",
                     "NewGELUActivation": "gelu_tanh", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh",
                     "FastGELUActivation": "gelu_tanh", "GELUPytorchTanh": "gelu_tanh"}


def activation_of(module) -> str | None:
    """The epilogue name of an activation module, or None for one the kernels do not have."""
    if type(module) is nn.GELU:
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    return _ACTIVATION_NAMES.get(type(module).__name__)


def _fuse_activations(model: nn.Module, built: dict) -> None:
    for name, layer in built.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        for act_attr in (act for linear, act in FUSED_ACTIVATIONS if linear == child):
            act = activation_of(getattr(parent, act_attr, None))
            if act and isinstance(layer, epilogues.Fusable) and layer.epilogue == "none":
                layer.fuse(act)
                setattr(parent, act_attr, FusedActivation(getattr(parent, act_attr), child))


class FusedActivation(nn.Identity):
    """Where patch took an activation into the preceding layer's epilogue (the parent's
    attribute `linear`): nothing to do here. The activation module is kept (not as a
    submodule: no state, not patched) for dense_copy to put back."""

    def __init__(self, activation: nn.Module, linear: str):
        super().__init__()
        self.__dict__["activation"] = activation
        self.linear = linear


class GatedMLP(nn.Module):
    """down(act(gate) * up) with gate and up as one sparse layer whose kernel applies
    the gated epilogue: one product and no elementwise pass between the projections."""

    def __init__(self, gate_up: nn.Module, down: nn.Module, replaced: nn.Module | None = None):
        super().__init__()
        self.gate_up, self.down_proj = gate_up, down
        # The model's own MLP without its projections (its class, activation and settings), for
        # dense_copy to rebuild; kept out of the module tree: it holds no tensors.
        self.__dict__["replaced"] = None if replaced is None else _without_projections(replaced)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up(x))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """A state_dict of the MLP unfused (gate and up apart: saved from a model patched with
        fuse=False, other rules, or none) is refused naming that, not by torch's key lists."""
        apart = sorted({key[len(prefix):].split(".")[0] for key in state_dict if key.startswith(prefix)}
                       - {"gate_up", "down_proj"})
        expect(not apart or any(key.startswith(prefix + "gate_up.") for key in state_dict),
               f"{prefix}gate_up's tensors (patch fused this MLP's gate and up into one layer)",
               f"{', '.join(prefix + part for part in apart)}: a state_dict of the MLP unfused. Patch the model "
               "this is loaded into as the saved one was (sparsegen.patch(..., fuse=False) keeps gate and up "
               "apart), or load the saved model's dense_copy into an unpatched one")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


@dataclass(frozen=True)
class GatedForm:
    """How a model's gated MLP, down(act(gate(x)) * up(x)), names its parts: gate and up as
    two linears (Llama, Qwen2, Mistral, Gemma: `gate_proj`, `up_proj`, `act_fn`) or as one
    whose first half of rows is the gate (Phi-3, GLM: `gate_up_proj`, `activation_fn`, the
    MLP classes in `classes`, whose forward is known to chunk it so)."""
    parts: tuple[str, ...]
    activation: str
    classes: tuple[str, ...] = ()

    def found_in(self, mlp: nn.Module) -> bool:
        return (all(isinstance(getattr(mlp, p, None), nn.Module) for p in (*self.parts, "down_proj"))
                and (not self.classes or type(mlp).__name__ in self.classes))

    def gate_and_up(self, mlp: nn.Module) -> tuple[tuple, tuple]:
        """((gate weight, up weight), (gate bias, up bias)) of the MLP's dense parts."""
        if len(self.parts) == 2:
            gate, up = (getattr(mlp, p) for p in self.parts)
            return (gate.weight, up.weight), (gate.bias, up.bias)
        both = getattr(mlp, self.parts[0])
        bias = (None, None) if both.bias is None else tuple(both.bias.chunk(2))
        return tuple(both.weight.chunk(2)), bias


GATED_FORMS = (GatedForm(("gate_proj", "up_proj"), "act_fn"),
               GatedForm(("gate_up_proj",), "activation_fn", classes=("Phi3MLP", "GlmMLP", "Glm4MLP")))


def gated_form(mlp: nn.Module) -> GatedForm | None:
    return next((form for form in GATED_FORMS if form.found_in(mlp)), None)


def _without_projections(mlp: nn.Module) -> nn.Module | None:
    """A copy of a gated MLP with its projections left out (the original keeps them), or
    None where anything else in it holds a tensor (a copy would hold it twice)."""
    names = (*gated_form(mlp).parts, "down_proj")
    kept = {name: mlp._modules[name] for name in names}
    try:
        mlp._modules.update(dict.fromkeys(names))
        holds_tensors = any(True for _ in (*mlp.parameters(), *mlp.buffers()))
        return None if holds_tensors else copy.deepcopy(mlp)
    finally:
        mlp._modules.update(kept)


# the gate's activation -> the gated epilogue: every activation the kernels have
_GATES = {act: gated for gated, act in epilogues.GATED.items()}


class _GatedPlan:
    """A gated MLP (a GatedForm) whose gate and up share a rule."""

    def __init__(self, name: str, mlp: nn.Module, form: GatedForm, settings: dict):
        self.name, self.mlp, self.form, self.settings = name, mlp, form, settings
        prefix = f"{name}." if name else ""
        self.projections = tuple(prefix + part for part in form.parts)

    def build(self, from_dense: bool) -> GatedMLP:
        (gate, up), (gate_bias, up_bias) = self.form.gate_and_up(self.mlp)
        fused = epilogues.interleaved_linear(gate, up, gate_bias, up_bias)
        layer = _build(fused, self.settings, from_dense, self.projections[0])
        act = activation_of(getattr(self.mlp, self.form.activation))
        # (down_proj as the mlp holds it now: replaced where a rule matched it)
        return GatedMLP(layer.fuse(_GATES[act]), self.mlp.down_proj, self.mlp)


def fuse_loaded(model: nn.Module, layers: dict) -> dict[str, list[str]]:
    """What patch fuses, for a model whose linears are already sparsegen layers (`layers`,
    {name: layer}: a loaded checkpoint's, sparsegen.load_compressed): every gated MLP of either
    GatedForm whose gate and up are of one class that fuses such a pair (its `gated_pair`;
    a fused checkpoint projection split in its halves first, by the layer's tp_part) becomes a
    GatedMLP, each projection's stored values, kept positions (and scales) unchanged; an
    activation after an fc1-style layer goes into its epilogue. Returns {a GatedMLP's
    gate_up: [the projections it took]}."""
    found = [(name, mlp, form, layer) for name, mlp in model.named_modules() if name
             for form in [gated_form(mlp)] if form is not None
             for layer in [_loaded_pair(mlp, form)] if layer is not None]
    for name, mlp, _, layer in found:
        _replace(model, name, GatedMLP(layer, mlp.down_proj, mlp))
    fused = {f"{name}.gate_up": [f"{name}.{part}" for part in form.parts] for name, _, form, _ in found}
    taken = {part for parts in fused.values() for part in parts}
    _fuse_activations(model, {name: layer for name, layer in layers.items() if name not in taken})
    return fused


def _loaded_pair(mlp: nn.Module, form: GatedForm) -> nn.Module | None:
    """A gated MLP's gate and up as one layer, where they are of one layer class that fuses
    them (gated_pair: None for a pair it cannot take as one), with a gated activation; else None."""
    parts = [getattr(mlp, part) for part in form.parts]
    if len(parts) == 1:  # one checkpoint projection, the gate's rows first: its halves
        parts = _halves(parts[0])
    kind = type(parts[0]) if parts else None
    if not (hasattr(kind, "gated_pair") and type(parts[1]) is kind
            and _pair_fits(mlp, form, parts[0].out_features, (parts[0].bias, parts[1].bias))):
        return None
    return kind.gated_pair(parts[0], parts[1], _GATES[activation_of(getattr(mlp, form.activation))])


def _pair_fits(mlp: nn.Module, form: GatedForm, gate_rows: int, biases: tuple) -> bool:
    """What every fused pair needs: whole groups of rows to interleave, one bias presence, an
    activation with a gated epilogue."""
    return (gate_rows % epilogues.GATE_GROUP == 0 and (biases[0] is None) == (biases[1] is None)
            and activation_of(getattr(mlp, form.activation, None)) in _GATES)


def _halves(layer: nn.Module) -> list[nn.Module]:
    """A sparse layer's first and second half of rows as layers of its kind (tp_part), or []
    where it cannot be split so (no tp_part, rows not in its granules)."""
    half = getattr(layer, "out_features", 0) // 2
    if not (callable(getattr(layer, "tp_part", None)) and half and half % layer.tp_granules()[0] == 0):
        return []
    columns = slice(0, layer.in_features)
    return [layer.tp_part(slice(0, half), columns, True), layer.tp_part(slice(half, 2 * half), columns, True)]


def _gated_mlps(model: nn.Module, plan) -> list[_GatedPlan]:
    settings = {name: s for name, _, s in plan}
    found = []
    for name, module in model.named_modules():
        form = gated_form(module) if name else None  # (the root stays)
        if form is None:
            continue
        rules = [settings.get(f"{name}.{part}") for part in form.parts]
        if rules[0] is not None and all(rule == rules[0] for rule in rules) and _fusable_gate(module, form, rules[0]):
            found.append(_GatedPlan(name, module, form, rules[0]))
    return found


def _fusable_gate(mlp: nn.Module, form: GatedForm, settings: dict) -> bool:
    """Gate and up as plain linears of one shape and bias (halves of one for a fused form),
    of whole groups of rows to interleave, an activation with a gated epilogue, and settings
    under which the layout pairs them (its face says: no fixed block layout, no training
    recipe, no block-diagonal or block-ELL)."""
    parts = [getattr(mlp, part) for part in form.parts]
    if not all(type(part) is nn.Linear for part in parts):
        return False
    (gate, up), biases = form.gate_and_up(mlp)
    return (gate.shape == up.shape and _pair_fits(mlp, form, gate.shape[0], biases)
            and _face_of(settings).pairs(settings))


def _plan(model: nn.Module, rules: dict) -> list[tuple[str, nn.Module, dict]]:
    compiled = [(pattern, _regex(pattern), _checked(pattern, settings)) for pattern, settings in rules.items()]
    linears = [(name, module) for name, module in model.named_modules() if _dense_weight(module) is not None]
    plan, used = [], set()
    for name, module in linears:
        for pattern, regex, settings in compiled:
            if matches(regex, name):
                plan.append((name, module, settings))
                used.add(pattern)
                break
    unused = [pattern for pattern, _, _ in compiled if pattern not in used]
    expect(not unused, "every pattern to match a linear layer's name (the whole qualified name, or a "
           r"whole dotted suffix of it: 'mlp\.up_proj' matches 'model.layers.0.mlp.up_proj')",
           f"no match for {unused}; {_unmatched_hint(model, unused, [name for name, _ in linears])}")
    return plan


def _check_roles(plan: list, rules: dict, strict: bool) -> None:
    """Warn (strict: refuse) where one pattern matched the same suffix under parents of
    different roles (their names with layer numbers as #): a pattern widened past its intent."""
    for pattern in rules:
        regex, roles = _regex(pattern), {}
        for name, _, _ in plan:
            parts, start = name.split("."), matched_at(regex, name)
            if start is not None:
                suffix, parent = ".".join(parts[start:]), re.sub(r"\d+", "#", ".".join(parts[:start]))
                roles.setdefault(suffix, set()).add(parent)
        wide = {suffix: sorted(parents) for suffix, parents in roles.items() if len(parents) > 1}
        if wide:
            suffix, parents = next(iter(wide.items()))
            message = (f"pattern {pattern!r} matches {suffix!r} in {len(parents)} roles: "
                       + ", ".join(f"{p}.{suffix}" for p in parents)
                       + f"; anchor it to the one meant with a longer suffix, e.g. {_anchored(parents[0], suffix)!r}")
            expect(not strict, "each pattern to match its suffix in one role (strict=True)", message)
            warnings.warn(f"sparsegen.patch: {message}", UserWarning, stacklevel=3)


def _anchored(parent: str, suffix: str) -> str:
    """A pattern for `suffix` under the last two parts of `parent` (layer numbers as \\d+)."""
    parts = [p for p in parent.split(".") if p][-2:] + suffix.split(".")
    return r"\.".join(r"\d+" if p == "#" else re.escape(p) for p in parts)


def _unmatched_hint(model: nn.Module, patterns: list[str], names: list[str]) -> str:
    """Why the patterns matched nothing, for the error: the layers sparsegen already made that
    they match (a model patched twice, as a notebook cell run again does), else the linear
    layers' names most like them."""
    regexes = [_regex(pattern) for pattern in patterns]
    made = [name for name, module in model.named_modules()
            if _is_sparse_layer(module) and any(matches(regex, name) for regex in regexes)]
    if not made:
        return _closest(patterns, names)
    shown = ", ".join(made[:3]) + (f" ({len(made)} in all)" if len(made) > 3 else "")
    return (f"they match only layers sparsegen already made: {shown}. Patch a model once; for other "
            "settings patch a fresh copy of the dense model")


def matches(regex: re.Pattern, name: str) -> bool:
    """Whether a rule's pattern matches a module's qualified name: the whole name, or the whole
    of a dotted suffix of it, as PEFT's target_modules match (a transformers model's names
    start with its base model's attribute: model.layers.0..., transformer.h.0...)."""
    return matched_at(regex, name) is not None


def matched_at(regex: re.Pattern, name: str) -> int | None:
    """Where in the dotted name the matched suffix starts (a part's index), or None."""
    parts = name.split(".")
    return next((i for i in range(len(parts)) if regex.fullmatch(".".join(parts[i:]))), None)


def _closest(patterns: list[str], names: list[str]) -> str:
    """The linear layers' names most like the patterns, for the error (or that there are none)."""
    if not names:
        return "the model has no nn.Linear (or transformers Conv1D) layers"
    close = {near for pattern in patterns for near in difflib.get_close_matches(pattern, names, n=3, cutoff=0.0)}
    shown = sorted(close) or names[:3]
    return f"the closest linear layers are {', '.join(shown)} ({len(names)} in all)"


def _regex(pattern) -> re.Pattern:
    expect(isinstance(pattern, str), "rule patterns as strings (regular expressions)", repr(pattern))
    try:
        return re.compile(pattern)
    except re.error as error:
        raise InputError(f"Expected rule patterns that are regular expressions. Got {pattern!r} ({error}).") from None


def _checked(pattern: str, settings) -> dict:
    expect(isinstance(settings, dict) and set(settings) <= set(_SETTINGS),
           f"settings for {pattern!r} as a dict with keys from {_SETTINGS}", settings)
    sparsity = settings.get("sparsity", "block")
    expect(sparsity in RULE_SETTINGS, f"sparsity for {pattern!r} one of {tuple(RULE_SETTINGS)}", repr(sparsity))
    unused = sorted(set(settings) - {"sparsity", *RULE_SETTINGS[sparsity]})
    expect(not unused, f"only settings that sparsity {sparsity!r} takes for {pattern!r}: "
           f"{', '.join(RULE_SETTINGS[sparsity])}", f"also {', '.join(unused)}")
    FACES[sparsity].check_rule(pattern, settings)
    return dict(settings)


def _face_of(settings: dict):
    """The face a checked rule's settings name (block-sparse where they name none)."""
    return FACES[settings.get("sparsity", "block")]


def _dense_weight(module: nn.Module) -> torch.Tensor | None:
    """[out, in] weight of an nn.Linear, or of a transformers Conv1D (stored [in, out])."""
    if type(module) is nn.Linear:  # not subclasses: MultiheadAttention reads out_proj.weight itself
        return module.weight
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return module.weight.t()
    return None


def _build(module: nn.Module, settings: dict, from_dense: bool, name: str) -> nn.Module:
    weight = _dense_weight(module)
    expect(not (from_dense and weight.is_meta), f"{name}: weights to prune (from_dense=True), or from_dense=False "
           "for a model built on the meta device (layers to load a checkpoint into)", "weights on the meta device")
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None,
                       device="meta")
    linear.weight, linear.bias = nn.Parameter(weight.detach()), module.bias
    try:
        layer = _face_of(settings).make_patched(linear, settings, from_dense)
    except InputError as error:
        raise InputError(f"{name}: {error}") from None
    if type(module) is not nn.Linear:  # (a Conv1D: its weight is stored [in, out])
        layer.replaced_class = type(module)
    return layer


def _is_sparse_layer(module: nn.Module) -> bool:
    """A layer of any of sparsegen's layouts: each has to_linear (its weight as nn.Linear)."""
    return type(module).__module__.startswith("sparsegen.") and callable(getattr(module, "to_linear", None))
