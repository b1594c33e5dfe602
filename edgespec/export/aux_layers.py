"""Which of the target's layers an EAGLE-3 head reads (its "aux layers"): the one home of the
default and of the check, for the exporter, the distillation recipe and the CLI alike.

The default never repeats a layer, and ``edgespec distill --aux-layers`` may not: a repeat is
refused in one line naming it. Layers named otherwise (a head's own config, which says what the
head was trained on; a caller of the recipe's head_config) may repeat one, as a 2-layer target
must: they are read as named.

Light on purpose (no torch): ``edgespec distill --help`` states the rule from RULE.
"""

from __future__ import annotations

from edgespec.errors import ExportError, shown

# the default in words, as help texts and docs/export.md state it
RULE = "2, L/2, L-3 (vLLM's and EAGLE's); a target under 7 layers: L/4, L/2, L-1"


def default_aux_layers(target_layers: int) -> tuple[int, int, int]:
    """Low, middle and high layers of an L-layer target: (2, L // 2, L - 3), as vLLM and the
    EAGLE repository pick them; under 7 layers those repeat or leave the target, so
    (L // 4, L // 2, L - 1). Refuses (ExportError) a target too shallow for three layers."""
    paper = (2, target_layers // 2, target_layers - 3)
    if 2 < paper[1] < paper[2]:
        return paper
    if target_layers < 3:
        raise ExportError(f"a {target_layers}-layer target has no three different layers to "
                          "read; the head needs eagle_config.eagle_aux_hidden_state_layer_ids")
    return (target_layers // 4, target_layers // 2, target_layers - 1)


def aux_layers_problem(aux: object, target_layers: int | None,
                       repeats: bool = False) -> str | None:
    """What is wrong with ``aux`` as three layer ids of the target (of any depth when
    ``target_layers`` is None), different ones unless ``repeats``; or None."""
    high = (1 << 31) if target_layers is None else target_layers
    if not isinstance(aux, (list, tuple)) or len(aux) != 3 or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < high for i in aux):
        return (f"aux hidden-state layers {shown(aux)} must be three layer ids in "
                f"0..{high - 1} of the target")
    repeated = sorted({i for i in aux if list(aux).count(i) > 1})
    if repeated and not repeats:
        return (f"aux hidden-state layers {shown(tuple(aux))} repeat layer "
                f"{', '.join(map(str, repeated))}; name three different layers")
    return None


def check_aux_layers(aux: object, target_layers: int | None,
                     repeats: bool = False) -> tuple[int, int, int]:
    """``aux`` as a tuple, or ExportError (one line naming the layers) when it is not three
    layer ids of a ``target_layers``-layer target (None: any depth), different ones unless
    ``repeats``."""
    problem = aux_layers_problem(aux, target_layers, repeats)
    if problem:
        raise ExportError(f"{problem} (eagle_config.eagle_aux_hidden_state_layer_ids, or "
                          "--aux-layers)")
    return tuple(aux)  # type: ignore[arg-type]
