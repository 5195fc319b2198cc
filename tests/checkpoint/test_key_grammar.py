"""Parameter names are built and parsed in one module (megafab/param_names.py): no other file in
megafab/ spells Megatron's `decoder.layers` in code, formats a layer number into a name, runs a
regex over layer names or reads a layer number out of a split name. And the grammar itself:
renumbering between global and stage-local layers, stacked names, TE names, legacy rank dirs."""

import ast
import pathlib

import pytest

from megafab import param_names as keys

ROOT = pathlib.Path(__file__).resolve().parents[2] / "megafab"
GRAMMAR = ROOT / "param_names.py"
REGEX_CALLS = {"compile", "match", "fullmatch", "search", "sub", "findall", "finditer", "split"}


def _docstrings(tree) -> set[int]:
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                  ast.ClassDef)))]
    return {id(n.body[0].value) for n in nodes
            if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def _name_grammar_outside_keys(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text())
    docs, found = _docstrings(tree), []
    for node in ast.walk(tree):
        where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if "decoder.layers" in node.value or "layers\\." in node.value:  # plain, or a regex's
                found.append(f"{where}: literal {node.value!r}")
        elif isinstance(node, ast.JoinedStr):  # f"...layers.{i}..."
            for part, nxt in zip(node.values, node.values[1:]):
                if (isinstance(part, ast.Constant) and str(part.value).endswith("layers.")
                        and isinstance(nxt, ast.FormattedValue)):
                    found.append(f"{where}: f-string formats a layer number")
        elif isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "re"
                    and func.attr in REGEX_CALLS and node.args and isinstance(node.args[0], ast.Constant)
                    and "layers" in str(node.args[0].value)):
                found.append(f"{where}: regex over layer names")
            if isinstance(func, ast.Name) and func.id == "int" and any(
                    isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                    and n.func.attr in ("split", "rsplit", "partition") and n.args
                    and isinstance(n.args[0], ast.Constant) and n.args[0].value == "."
                    for arg in node.args for n in ast.walk(arg)):
                found.append(f"{where}: a number read out of a split name")
    return found


def test_no_file_but_keys_builds_or_parses_layer_names():
    files = [p for p in ROOT.rglob("*.py") if p != GRAMMAR]
    assert len(files) > 50
    found = [f for p in files for f in _name_grammar_outside_keys(p)]
    assert not found, "\n".join(found)


def test_the_check_finds_each_way_the_grammar_used_to_be_written(tmp_path):
    """Each form that lived outside keys.py before (regex, f-string, split + int, a literal)."""
    for source in ('import re\nLAYER = re.compile(r"^decoder\\.layers\\.(\\d+)\\.(.+)$")\n',
                   'def f(i, m):\n    return f"decoder.layers.{i}.{m}"\n',
                   'def f(n):\n    return int(n.split(".")[2])\n',
                   'def f(n):\n    return n.startswith("decoder.layers.")\n'):
        file = tmp_path / "m.py"
        file.write_text(source)
        assert _name_grammar_outside_keys(file, tmp_path), source


def test_layers_renumber_between_global_and_stage_numbers():
    name = "decoder.layers.7.mlp.linear_fc1.weight"
    assert keys.parse_index(name) == (7, "mlp.linear_fc1.weight") and keys.layer_of(name) == 7
    assert keys.to_stage(name, 4) == "decoder.layers.3.mlp.linear_fc1.weight"
    assert keys.to_global(keys.to_stage(name, 4), 4) == name
    assert keys.to_stage("embedding.word_embeddings.weight", 4) == "embedding.word_embeddings.weight"
    assert keys.parse_index("decoder.layers.x.weight") is None
    assert keys.parse_index("decoder.layers.3") is None
    assert keys.stacked_name(name) == ("decoder.layers.mlp.linear_fc1.weight", 7)
    assert keys.unstacked_name(*keys.stacked_name(name)) == name
    assert keys.layer_prefix(2, "model.layers.") == "model.layers.2."
    names = ["decoder.layers.10.a", "output_layer.weight", "decoder.layers.9.a"]
    assert sorted(names, key=keys.layer_order) == [names[1], names[2], names[0]]


def test_te_names_and_legacy_rank_files():
    local = "decoder.layers.3.pre_mlp_layernorm.weight"
    assert keys.local_to_te_name(local) == "decoder.layers.3.mlp.linear_fc1.layer_norm_weight"
    assert keys.te_to_local_name(keys.local_to_te_name(local)) == local
    assert keys.te_to_local_name("decoder.layers.0.self_attention.core_attention._extra_state") is None
    for tp_rank, pp_rank, pp in ((0, 0, 1), (3, 0, 1), (1, 12, 16)):
        name = keys.rank_dir(tp_rank, pp_rank, pp)
        assert keys.parse_rank_dir(name) == (tp_rank, pp_rank, False)
    assert keys.parse_rank_dir("mp_rank_01_002_003") == (1, 2, True)
    for other in ("mp_rank_1", "mp_rank_01_2", "mp_rank_ab", "rng", "mp_rank_01_002_003_004"):
        assert keys.parse_rank_dir(other) is None, other
    state = {"model1": 0, "model0": 0, "args": 0, "model10": 0}
    assert keys.chunk_keys(state) == ["model0", "model1", "model10"]
    assert [keys.chunk_key(c, 2) for c in range(2)] == ["model0", "model1"]
    assert keys.chunk_key(0, 1) == "model"


@pytest.mark.parametrize("name, swiglu, split", [
    ("embedding.word_embeddings.weight", False, (0, 1)),
    ("output_layer.weight", True, (0, 1)),
    ("decoder.layers.2.self_attention.linear_qkv.weight", True, (0, 1)),
    ("decoder.layers.2.mlp.linear_fc1.weight", True, (0, 2)),
    ("decoder.layers.2.mlp.linear_fc1.bias", False, (0, 1)),
    ("decoder.layers.2.mlp.linear_fc2.weight", True, (1, 1)),
    ("decoder.layers.2.mlp.linear_fc2.bias", True, None),
    ("decoder.layers.2.mlp.linear_fc1.layer_norm_weight", True, None),  # TE's fused norm: replicated
    ("embedding.position_embeddings.weight", False, None),
])
def test_the_tp_partition_table(name, swiglu, split):
    assert keys.tp_partition(name, swiglu) == split
