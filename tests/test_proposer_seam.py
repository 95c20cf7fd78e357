"""The proposer seam (specd.speculation.proposal / registry): a proposer added in one file plus one
registry line drafts through ``ngram`` mode and ``auto``, is priced at its own acceptance, and
never changes greedy output (it equals plain decoding token for token)."""

import pytest

from specd.config import EngineConfig, SpecConfig, SpecMode
from specd.engine.engine import Engine
from specd.sampling.params import SamplingParams
from specd.speculation import registry
from specd.speculation.request import SpecParams
from tests.conftest import DRAFT, TARGET
from tests.toy_proposer import TableProposer

GREEDY = SamplingParams(temperature=0, max_tokens=48)
STORIES = ["Once upon a time, there was a little", "Tom had a big red ball. One day", "The cat and the dog"]


@pytest.fixture(scope="module")
def plain(shared_pair):
    t, d = shared_pair
    eng = Engine(EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=SpecConfig(adaptive=False)), t, d)
    prompts = [eng.tokenizer(s)["input_ids"] for s in STORIES]
    seqs = eng.generate(prompts, GREEDY, SpecParams(mode="off"))
    return prompts, [s.output_ids for s in seqs], sum(s.stats.steps for s in seqs)


@pytest.fixture
def registered():
    made = []

    def add(name, **kw):
        registry.register(name, lambda ctx: made.append(TableProposer(name=name, **kw)) or made[-1])
        return made

    yield add
    for p in made:
        registry.unregister(p.name)
    for name in ("table", "liar"):
        registry.unregister(name)


def _engine(shared_pair, **spec):
    t, d = shared_pair
    return Engine(EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=SpecConfig(**spec)), t, d)


@pytest.mark.parametrize("mode", ["auto", "ngram"])
def test_a_registered_proposer_drafts_through_auto_and_ngram(shared_pair, plain, registered, mode):
    prompts, ref, plain_steps = plain
    made = registered("table", table={tuple(p): r for p, r in zip(prompts, ref)})
    eng = _engine(shared_pair, mode="tree", adaptive=True)
    assert [p.name for p in eng.speculator.free] == ["ngram", "grammar", "table"]
    seqs = eng.generate(prompts, GREEDY, SpecParams(mode=mode))
    assert [s.output_ids for s in seqs] == ref  # lossless
    row = eng.stats.by_proposer.get("table")
    assert row is not None and row[2] > 0, eng.stats.by_proposer  # it drafted and was accepted
    assert made[0].observed == row[2]  # it was told what was accepted
    assert sorted(made[0].forgotten) == sorted(s.request_id for s in seqs)  # and forgot finished requests
    assert sum(s.stats.steps for s in seqs) < plain_steps  # and it paid: fewer target forwards
    assert all(s.spec_state.accept["table"] > 0.5 for s in seqs)  # priced at its own acceptance


def test_a_proposer_that_is_always_wrong_changes_nothing_and_loses_its_price(shared_pair, plain, registered):
    prompts, ref, _ = plain
    registered("liar", table={tuple(p): r for p, r in zip(prompts, ref)}, liar=True)
    eng = _engine(shared_pair, mode="ngram", adaptive=True)
    seqs = eng.generate(prompts, GREEDY, SpecParams(mode="ngram"))
    assert [s.output_ids for s in seqs] == ref
    steps, drafted, accepted = eng.stats.by_proposer["liar"]
    assert drafted > 0 and accepted == 0
    assert all(s.spec_state.accept["liar"] < 0.5 for s in seqs)  # its acceptance fell from its 0.9 prior


def test_registry_names_are_unique_and_builtin_lookup_is_listed():
    assert "ngram" in registry.FREE_PROPOSERS
    with pytest.raises(ValueError, match="registered already"):
        registry.register("ngram", lambda ctx: None)


def test_spec_modes_are_an_enum_that_compares_as_strings():
    assert SpecParams(mode="tree").mode is SpecMode.TREE and SpecMode.TREE == "tree"
    assert SpecConfig(mode="ngram").mode is SpecMode.NGRAM
    with pytest.raises(ValueError, match="speculation.mode"):
        SpecParams(mode="static")  # a server setting, not a request's
    with pytest.raises(ValueError, match="speculation mode"):
        SpecConfig(mode="auto")
