"""Plan files: the examples load, and every way a file can be wrong is one PlanError line."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.plan import Plan, PlanError, Rule, _toposort, load_plan, plan_from_dict
from engine.policy import MAX_ATTEMPTS
from engine.yamlfile import MAX_BYTES
from tests.helpers import PLANS_DIR, containers, example_plan, reversed_chain, sweep_order

# --- the example plans ------------------------------------------------------------------------


def test_code_review_plan_shape() -> None:
    plan = example_plan("code_review")
    assert plan.id == "code_review"
    assert len(plan.passes) >= 4
    assert len(plan.rules) >= 12
    assert all(r.description for r in plan.rules.values())
    # the diamond: compiles -> static_analysis, compiles -> test_run, both -> correctness_review
    assert set(plan.dependents("compiles")) >= {"static_analysis", "test_run"}
    assert set(plan.rules["correctness_review"].depends_on) == {"static_analysis", "test_run"}
    assert plan.rules["static_analysis"].pass_id != plan.rules["compiles"].pass_id
    # per-rule retry budgets
    assert plan.rules["license_header"].max_attempts == 1
    assert plan.rules["test_run"].max_attempts == 5
    assert plan.rules["compiles"].max_attempts is None


def test_code_review_plan_has_independent_branches() -> None:
    plan = example_plan("code_review")
    code = {"compiles"} | plan.transitive_dependents(["compiles"])
    docs = {"readme_present"} | plan.transitive_dependents(["readme_present"])
    assert len(code) >= 4 and len(docs) >= 3
    assert not code & docs
    # a permanent failure of compiles leaves the docs branch with nothing to lose
    for rid in docs:
        assert not set(plan.rules[rid].depends_on) & code


def test_tiny_plan_shape() -> None:
    plan = example_plan("tiny")
    assert [p.id for p in plan.passes] == ["quick", "deep"]
    assert plan.order == ("compiles", "style_check", "unit_tests", "feedback")
    assert plan.transitive_dependents(["compiles"]) == {"unit_tests", "feedback"}
    assert plan.transitive_dependents(["style_check"]) == frozenset()
    assert plan.rules["feedback"].pass_id == plan.rules["unit_tests"].pass_id == "deep"


@pytest.mark.parametrize("path", sorted(PLANS_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_plan_loads(path: Path) -> None:
    plan = load_plan(path)
    assert plan.order and set(plan.order) == set(plan.rules)


def test_json_plan_loads(tmp_path: Path) -> None:
    path = tmp_path / "tiny.json"
    path.write_text(example_plan("tiny").to_json())
    assert load_plan(path) == example_plan("tiny")


# --- queries ----------------------------------------------------------------------------------


def test_transitive_dependents() -> None:
    plan = example_plan("code_review")
    assert plan.transitive_dependents(["compiles"]) == {
        "static_analysis",
        "test_run",
        "security_review",
        "correctness_review",
        "code_feedback",
    }
    assert plan.transitive_dependents(["test_run"]) == {"correctness_review", "code_feedback"}
    assert plan.transitive_dependents(["license_header"]) == {"docs_feedback"}
    assert plan.transitive_dependents(["test_run", "docs_quality"]) == {
        "correctness_review",
        "code_feedback",
        "api_docs_consistency",
        "docs_feedback",
    }
    assert plan.transitive_dependents(["code_feedback"]) == frozenset()
    assert plan.transitive_dependents([]) == frozenset()
    assert plan.dependents("static_analysis") == ("security_review", "correctness_review")


def _assert_topological(plan: Plan) -> None:
    pos = {rid: i for i, rid in enumerate(plan.order)}
    assert sorted(pos) == sorted(plan.rules)
    assert len(plan.order) == len(plan.rules)
    for rid, rule in plan.rules.items():
        for dep in rule.depends_on:
            assert pos[dep] < pos[rid], f"{dep} must come before {rid}"
    pass_index = [
        next(i for i, p in enumerate(plan.passes) if rid in p.rule_ids) for rid in plan.order
    ]
    assert pass_index == sorted(pass_index), "order follows the passes"


@pytest.mark.parametrize("name", ["code_review", "tiny"])
def test_order_is_topological(name: str) -> None:
    _assert_topological(example_plan(name))


def test_order_puts_in_pass_dependencies_first() -> None:
    plan = plan_from_dict(
        {
            "plan": "p",
            "passes": [{"id": "p1", "rules": [{"id": "b", "depends_on": ["a"]}, {"id": "a"}]}],
        }
    )
    assert plan.order == ("a", "b")


@st.composite
def one_pass_dags(draw: st.DrawFn) -> tuple[list[str], dict[str, Rule]]:
    """The rules of one pass in file order, with edges drawn along a hidden topological
    rank (so no cycle), and some dependencies on rules of an earlier pass."""
    n = draw(st.integers(1, 12))
    rank = draw(st.permutations(range(n)))
    ids = [f"r{i}" for i in range(n)]
    rules = {}
    for i, rid in enumerate(ids):
        earlier = [ids[j] for j in range(n) if rank[j] < rank[i]]
        deps = draw(st.lists(st.sampled_from(earlier), unique=True)) if earlier else []
        if draw(st.booleans()):
            deps.append("previous_pass")
        rules[rid] = Rule(rid, "p", tuple(deps))
    return ids, rules


@settings(max_examples=200, deadline=None)
@given(one_pass_dags())
def test_linear_order_is_the_sweep_order(case: tuple[list[str], dict[str, Rule]]) -> None:
    ids, rules = case
    assert _toposort(ids, rules) == sweep_order(ids, rules)


def test_a_reversed_chain_of_3000_rules_loads_in_linear_time(tmp_path: Path) -> None:
    """It took over 20 s when each sweep of the pass placed one rule; now milliseconds (no
    timer here: a quadratic sort would make this test, not an assertion, slow)."""
    path = tmp_path / "chain.yaml"
    path.write_text(yaml.safe_dump(reversed_chain(3_000), sort_keys=False))
    plan = load_plan(path)
    assert plan.order == tuple(f"r{i}" for i in reversed(range(3_000)))
    assert len(plan.transitive_dependents(["r2999"])) == 2_999


def test_a_long_cycle_is_one_short_line() -> None:
    with pytest.raises(PlanError) as info:
        plan_from_dict(reversed_chain(3_000, cycle=True), source="chain.yaml")
    msg = _assert_one_line(info.value, Path("chain.yaml"))
    assert "dependency cycle r0 -> r1 -> r2 -> r3 -> r4 -> ... -> r0 (3000 rules)" in msg
    assert len(msg) < 200


def test_huge_values_are_clipped_in_the_error_line() -> None:
    data = copy.deepcopy(TINY)
    _rule(data, 1, 0)["depends_on"] = ["x" * 100_000]
    with pytest.raises(PlanError) as info:
        plan_from_dict(data, source="tiny.yaml")
    msg = _assert_one_line(info.value, Path("tiny.yaml"))
    assert "unknown rule 'xxx" in msg and msg.endswith("...") and len(msg) < 300
    data = copy.deepcopy(TINY)
    _rule(data, 1, 0)["id"] = "y" * 100_000
    with pytest.raises(PlanError) as info:
        plan_from_dict(data, source="tiny.yaml")
    assert len(_assert_one_line(info.value, Path("tiny.yaml"))) < 300


def test_max_attempts_has_the_engines_bound() -> None:
    data = copy.deepcopy(TINY)
    _rule(data, 1, 0)["max_attempts"] = MAX_ATTEMPTS
    plan_from_dict(data)
    _rule(data, 1, 0)["max_attempts"] = MAX_ATTEMPTS + 1
    with pytest.raises(
        PlanError, match=rf"max_attempts .*: expected a value <= {MAX_ATTEMPTS}; got"
    ):
        plan_from_dict(data, source="tiny.yaml")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "plan: a\nplan: b\npasses: []\n",
            "duplicate key 'plan' (line 2, column 1; first at line 1)",
        ),
        (
            "plan: a\npasses:\n  - id: p\n    rules:\n      - {id: r, id: s}\n",
            "duplicate key 'id' (line 5, column 17; first at line 5)",
        ),
    ],
    ids=["top", "rule"],
)
def test_duplicate_keys_are_refused(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert f"not valid YAML: {expected}; expected each key once" in _assert_one_line(
        info.value, path
    )


def test_merge_keys_may_still_override(tmp_path: Path) -> None:
    """`<<` merges are how YAML shares a mapping: a key set next to one is not a duplicate."""
    path = tmp_path / "merge.yaml"
    path.write_text(
        "plan: m\npasses:\n  - id: p\n    rules:\n"
        "      - &base {id: a, max_attempts: 2}\n      - {<<: *base, id: b}\n"
    )
    plan = load_plan(path)
    assert plan.rules["b"].max_attempts == 2


def test_a_device_is_not_a_plan(tmp_path: Path) -> None:
    with pytest.raises(PlanError) as info:
        load_plan("/dev/zero")
    assert _assert_one_line(info.value, Path("/dev/zero")).endswith(
        "cannot read plan: a character device; expected a regular file"
    )
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (MAX_BYTES + 1))
    with pytest.raises(PlanError) as info:
        load_plan(big)
    assert f"too large ({MAX_BYTES + 1} bytes)" in _assert_one_line(info.value, big)


@pytest.mark.parametrize("name", ["code_review", "tiny"])
def test_round_trip(name: str) -> None:
    plan = example_plan(name)
    again = plan_from_dict(plan.to_dict())
    assert again == plan
    assert again.to_dict() == plan.to_dict()
    assert plan_from_dict(json.loads(plan.to_json())) == plan
    assert again.order == plan.order


# --- one PlanError line for every way a file can be wrong ------------------------------------

TINY: dict[str, Any] = yaml.safe_load((PLANS_DIR / "tiny.yaml").read_text())


def _rule(d: dict[str, Any], pi: int, ri: int) -> dict[str, Any]:
    return d["passes"][pi]["rules"][ri]


Mutation = Callable[[dict[str, Any]], None]

BROKEN: list[tuple[str, Mutation, list[str]]] = [
    (
        "unknown_dependency",
        lambda d: _rule(d, 1, 0).update(depends_on=["compiles", "linting"]),
        ["passes[1].rules[0].depends_on", "'unit_tests'", "unknown rule 'linting'"],
    ),
    (
        "cycle_within_a_pass",
        lambda d: _rule(d, 1, 0).update(depends_on=["compiles", "feedback"]),
        ["passes[1].rules[0].depends_on", "'unit_tests'", "cycle", "feedback"],
    ),
    (
        "self_dependency",
        lambda d: _rule(d, 1, 1).update(depends_on=["feedback"]),
        ["passes[1].rules[1].depends_on", "'feedback'", "itself"],
    ),
    (
        "dependency_on_a_later_pass",
        lambda d: _rule(d, 0, 1).update(depends_on=["unit_tests"]),
        ["passes[0].rules[1].depends_on", "'style_check'", "later pass", "'unit_tests'"],
    ),
    (
        "dependency_listed_twice",
        lambda d: _rule(d, 1, 0).update(depends_on=["compiles", "compiles"]),
        ["passes[1].rules[0].depends_on", "'unit_tests'", "twice"],
    ),
    (
        "duplicate_rule_id",
        lambda d: _rule(d, 1, 1).update(id="compiles"),
        ["passes[1].rules[1].id", "duplicate rule id 'compiles'"],
    ),
    (
        "duplicate_pass_id",
        lambda d: d["passes"][1].update(id="quick"),
        ["passes[1].id", "duplicate pass id 'quick'"],
    ),
    (
        "bad_field_type",
        lambda d: _rule(d, 1, 0).update(max_attempts="three"),
        ["passes[1].rules[0].max_attempts", "'unit_tests'", "integer"],
    ),
    (
        "bool_is_not_an_int",
        lambda d: _rule(d, 1, 0).update(max_attempts=True),
        ["passes[1].rules[0].max_attempts", "'unit_tests'", "integer"],
    ),
    (
        "depends_on_not_a_list",
        lambda d: _rule(d, 1, 0).update(depends_on="compiles"),
        ["passes[1].rules[0].depends_on", "'unit_tests'", "list"],
    ),
    (
        "max_attempts_out_of_range",
        lambda d: _rule(d, 1, 0).update(max_attempts=0),
        ["passes[1].rules[0].max_attempts", "'unit_tests'", "expected a value >= 1"],
    ),
    (
        "bad_rule_id",
        lambda d: _rule(d, 0, 0).update(id="has space"),
        ["passes[0].rules[0].id", "expected an id"],
    ),
    (
        "unknown_rule_field",
        lambda d: _rule(d, 1, 0).update(retries=3),
        ["passes[1].rules[0].retries", "'unit_tests'", "unknown field"],
    ),
    (
        "unknown_top_field",
        lambda d: d.update(owner="me"),
        ["owner", "unknown field"],
    ),
    (
        "missing_rule_id",
        lambda d: _rule(d, 0, 1).pop("id"),
        ["passes[0].rules[1].id", "required field is missing"],
    ),
    (
        "missing_passes",
        lambda d: d.pop("passes"),
        ["passes", "required field is missing"],
    ),
    (
        "missing_plan_id",
        lambda d: d.pop("plan"),
        ["plan", "required field is missing"],
    ),
    (
        "empty_passes",
        lambda d: d.update(passes=[]),
        ["passes", "at least 1 item"],
    ),
    (
        "empty_rules",
        lambda d: d["passes"][0].update(rules=[]),
        ["passes[0].rules", "at least 1 item"],
    ),
]


def _assert_one_line(err: PlanError, path: Path) -> str:
    msg = str(err)
    assert len(msg.splitlines()) == 1, f"more than one line: {msg!r}"
    assert msg.startswith(f"{path}: ")
    chained = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    assert chained is None, "no traceback chain for the CLI"
    return msg


@pytest.mark.parametrize(("name", "mutate", "expected"), BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_plan_is_one_plan_error_line(
    tmp_path: Path, name: str, mutate: Mutation, expected: list[str]
) -> None:
    data = copy.deepcopy(TINY)
    mutate(data)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(PlanError) as info:
        load_plan(path)
    msg = _assert_one_line(info.value, path)
    assert name in msg
    for part in expected:
        assert part in msg, f"{part!r} not in {msg!r}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("- compiles\n- unit_tests\n", "expected a mapping"),
        ("just a sentence\n", "expected a mapping"),
        ("", "expected a mapping"),
        ("plan: [unclosed\n", "not valid YAML (line 2, column 1)"),
        ("plan: t\n  passes: : x\n", "not valid YAML (line 2"),
        ("plan: t\npasses:\n\t- id: p\n", "not valid YAML"),
        ("[" * 5_000, "not valid YAML"),
    ],
    ids=["list", "scalar", "empty", "unclosed", "bad_indent", "tab", "nested_too_deeply"],
)
def test_not_a_plan_document(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert expected in _assert_one_line(info.value, path)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("plan: revue_complète\n".encode("latin-1"))
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert "UTF-8" in _assert_one_line(info.value, path)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert "No such file" in _assert_one_line(info.value, path)


def test_directory_is_not_a_plan(tmp_path: Path) -> None:
    with pytest.raises(PlanError) as info:
        load_plan(tmp_path)
    assert "cannot read plan" in _assert_one_line(info.value, tmp_path)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (
            lambda d: _rule(d, 1, 0).update(depends_on=["compiles\nfeedback"]),
            r"'compiles\nfeedback'",
        ),
        (lambda d: _rule(d, 1, 0).update({"max\nattempts": 3}), r"max\nattempts"),
        (lambda d: _rule(d, 1, 0).update(id="unit\r\ntests"), r"'unit\r\ntests'"),
        (lambda d: d.update({"passes\u2028": []}), r"passes\u2028"),
    ],
    ids=["dependency", "field", "rule_id", "unicode_line_separator"],
)
def test_line_breaks_from_the_file_are_escaped(mutate: Mutation, expected: str) -> None:
    data = copy.deepcopy(TINY)
    mutate(data)
    with pytest.raises(PlanError) as info:
        plan_from_dict(data, source="tiny.yaml")
    msg = _assert_one_line(info.value, Path("tiny.yaml"))
    assert expected in msg


@pytest.mark.parametrize("data", [None, [], "plan", 3, [TINY]], ids=repr)
def test_plan_from_dict_needs_a_mapping(data: Any) -> None:
    with pytest.raises(PlanError, match=r"^src\.yaml: expected a mapping"):
        plan_from_dict(data, source="src.yaml")


# --- fuzzing: nothing but PlanError ever escapes ---------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 30)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
rule_ids = st.sampled_from(
    ["compiles", "style_check", "unit_tests", "feedback", "x", "", "unit_tests\n", "a\u2028b"]
)
field_names = st.sampled_from(
    ["id", "plan", "passes", "rules", "depends_on", "max_attempts", "description", "extra"]
)


@st.composite
def mutated_plans(draw: st.DrawFn) -> Any:
    """The tiny plan with a few random edits: values replaced, keys added or removed,
    dependencies rewired; most results are broken, a few are still valid."""
    data = copy.deepcopy(TINY)
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.sampled_from(containers(data)))
        node = data
        for key in where:
            node = node[key]
        op = draw(st.sampled_from(["set", "delete", "depend", "replace_root"]))
        if op == "replace_root":
            data = draw(json_values)
            break
        if isinstance(node, dict):
            key = draw(field_names | st.text(max_size=4) | st.sampled_from(["a\nb", "id\r"]))
            if op == "delete":
                node.pop(key, None)
            elif op == "depend":
                node["depends_on"] = draw(st.lists(rule_ids, max_size=3))
            else:
                node[key] = draw(json_values | rule_ids)
        elif node:
            i = draw(st.integers(0, len(node) - 1))
            if op == "delete":
                del node[i]
            else:
                node[i] = draw(json_values | rule_ids)
    return data


@settings(max_examples=300, deadline=None)
@given(data=mutated_plans() | json_values)
def test_plan_from_dict_raises_only_plan_error(data: Any) -> None:
    try:
        plan = plan_from_dict(data, source="fuzz.yaml")
    except PlanError as err:
        msg = str(err)
        assert msg.startswith("fuzz.yaml: ") and len(msg.splitlines()) == 1
    else:
        _assert_topological(plan)
        assert plan_from_dict(plan.to_dict()) == plan


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    content=st.text(max_size=200)
    | st.binary(max_size=100)
    | mutated_plans().map(lambda d: yaml.safe_dump(d, sort_keys=False))
)
def test_load_plan_raises_only_plan_error(
    tmp_path_factory: pytest.TempPathFactory, content: str | bytes
) -> None:
    path = tmp_path_factory.getbasetemp() / "fuzzed-plan.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8", errors="surrogatepass")
    try:
        load_plan(path)
    except PlanError as err:
        msg = str(err)
        assert msg.startswith(f"{path}: ") and len(msg.splitlines()) == 1
