"""World, corpus, retrieval, tokenizer, metrics and user-data loading of memopd.env."""
import json

import pytest

from memopd.env import (
    BM25Retriever,
    DataError,
    Document,
    World,
    WorldConfig,
    build_tokenizer,
    load_corpus_jsonl,
    load_tasks_jsonl,
    load_tokenizer,
    score_answers,
)
from memopd.env.qa.protocol import SPECIAL_TOKENS, ProtocolTokens
from memopd.env.qa.world import parse_question


def test_world_deterministic_from_seed():
    a = World.generate(WorldConfig(seed=3, n_entities=24))
    b = World.generate(WorldConfig(seed=3, n_entities=24))
    c = World.generate(WorldConfig(seed=4, n_entities=24))
    assert a.entities == b.entities and a.facts == b.facts and a.documents == b.documents
    assert a.documents != c.documents
    ta = [t.to_json() for t in a.sample_tasks(4, 5, split="train")]
    assert ta == [t.to_json() for t in b.sample_tasks(4, 5, split="train")]
    assert ta != [t.to_json() for t in a.sample_tasks(4, 5, split="eval")]
    # relations are permutations without fixed points
    for r in a.config.relations:
        targets = [a.facts[(x, r)] for x in a.entities]
        assert sorted(targets) == sorted(a.entities)
        assert all(x != a.facts[(x, r)] for x in a.entities)


def test_tasks_answers_consistent_with_world():
    w = World.generate(WorldConfig(seed=1, n_entities=30))
    for t in w.sample_tasks(8, 10):
        assert len(set(t.questions)) == t.k == 8
        for q, ans, sup in zip(t.questions, t.answers, t.support):
            attr, rel, x = parse_question(q)
            assert ans == [w.answer(attr, x, rel)]
            assert len(sup) == (1 if rel is None else 2)


def test_bm25_finds_supporting_documents():
    w = World.generate(WorldConfig(seed=0))
    r = BM25Retriever(w.documents, top_k=3)
    n = 0
    for t in w.sample_tasks(16, 8, split="eval"):
        for i, (q, sup) in enumerate(zip(t.questions, t.support), start=1):
            attr, rel, x = parse_question(q)
            # the queries the expert sends: "q<i> x k<i> key" for hop 1, "r<i> attr mid" for hop 2
            queries = [f"q{i} {x} k{i} {attr}"] if rel is None else [f"q{i} {x} k{i} {rel}",
                                                                       f"r{i} {attr} {w.facts[(x, rel)]}"]
            for query, doc_id in zip(queries, sup):
                # titled documents: the true fact names its entity twice and ranks first
                assert r.rank_of(query, doc_id) == 0, (query, doc_id, [d.id for d in r.search(query)])
                n += 1
    assert n >= 128
    assert r.search("zzzz qqqq") == []  # unknown words: no result


def test_tokenizer_special_tokens_and_hf_roundtrip(tmp_path):
    w = World.generate(WorldConfig(seed=0, n_entities=16))
    tok = build_tokenizer(w.vocabulary_texts())
    p = ProtocolTokens.from_tokenizer(tok)
    for s in SPECIAL_TOKENS:
        assert len(tok.encode(s, add_special_tokens=False)) == 1
    text = f"<mem> xa {w.entities[0]}</mem><search> qa {w.entities[1]} ka city</search>"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == p.mem_open and ids[-1] == p.search_close and len(ids) == 10  # every word one token
    assert tok.decode(ids) == text
    odd = "<mem> Q1 = 42!</mem>"  # not world words, still lossless (ASCII alphabet)
    assert tok.decode(tok.encode(odd, add_special_tokens=False)) == odd
    # A checkpoint directory (Qwen2 config + tokenizer): AutoTokenizer rebuilds it as a
    # Qwen2Tokenizer, which must encode exactly as the tokenizer we built.
    from memopd.models import tiny_causal_lm_config

    tok.save_pretrained(tmp_path)
    tiny_causal_lm_config("qwen2", vocab_size=len(tok)).save_pretrained(tmp_path)
    tok2 = load_tokenizer(tmp_path)
    assert type(tok2).__name__ == "Qwen2Tokenizer"
    for d in w.documents[:50]:
        s = " " + d.display
        assert tok2.encode(s, add_special_tokens=False) == tok.encode(s, add_special_tokens=False)
        assert len(tok.encode(s, add_special_tokens=False)) == len(s.split())  # one token per word
    assert tok2.encode(text, add_special_tokens=False) == ids
    bpe = build_tokenizer([d.text for d in w.documents], kind="bpe", vocab_size=400)
    assert ProtocolTokens.from_tokenizer(bpe).mem_open == p.mem_open
    assert bpe.decode(bpe.encode(" Überraschung 123", add_special_tokens=False)) == " Überraschung 123"
    assert bpe.decode(bpe.encode(" Überraschung 123", add_special_tokens=False)) == " Überraschung 123"
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        build_tokenizer(["x"], kind="nope")


def test_metrics_em_f1():
    s = score_answers(["Paris", "the red car", ""], [["paris"], ["red"], ["x"]])
    assert s["em"] == [1.0, 0.0, 0.0]
    assert s["f1"][1] == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert s["em_sum"] == 1.0 and s["em_mean"] == pytest.approx(1 / 3)
    assert score_answers(None, [["a"], ["b"]])["f1_sum"] == 0.0


def test_user_jsonl_loading(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"id": "d1", "text": "Paris is the capital of France.", "title": "Paris"}\n'
                      '\n{"id": 2, "text": "Berlin is in Germany."}\n')
    docs = load_corpus_jsonl(corpus)
    assert docs == [Document("d1", "Paris is the capital of France.", "Paris"), Document("2", "Berlin is in Germany.")]
    assert docs[0].display == "Paris : Paris is the capital of France." and docs[1].display == docs[1].text
    qs = tmp_path / "q.jsonl"
    qs.write_text(json.dumps({"questions": ["capital of France?", "where is Berlin?"],
                              "answers": [["Paris"], "Germany"]}) + "\n")
    tasks = load_tasks_jsonl(qs)
    assert tasks[0].answers == [["Paris"], ["Germany"]] and tasks[0].k == 2 and tasks[0].task_id == "q-00000"

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: duplicate document id"):
        load_corpus_jsonl(bad)
    bad.write_text('{"id": "a", "text": "x"}\n{"id": "b" "text": "y"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        load_corpus_jsonl(bad)
    bad.write_text('{"id": "a"}\n')
    with pytest.raises(DataError, match=r":1: a document needs both"):
        load_corpus_jsonl(bad)
    bad.write_text('{"id": "a", "text": "x", "body": "y"}\n')
    with pytest.raises(DataError, match=r":1: unknown fields \['body'\]"):
        load_corpus_jsonl(bad)
    bad.write_text(json.dumps({"questions": ["a?", "b?"], "answers": [["x"]]}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: 2 questions but 1 answers"):
        load_tasks_jsonl(bad)
    bad.write_text(json.dumps({"questions": ["a?"], "answers": [[]]}) + "\n")
    with pytest.raises(DataError, match=r"answers\[0\] must be a non-empty list"):
        load_tasks_jsonl(bad)
    with pytest.raises(DataError, match="does not exist"):
        load_corpus_jsonl(tmp_path / "missing.jsonl")


def test_user_corpus_episode(tmp_path):
    """A user corpus + question sets run through the same environment (BPE tokenizer)."""
    from memopd.env import EnvConfig, QAEnv

    docs = [Document("fr", "Paris is the capital of France."), Document("de", "Berlin is the capital of Germany."),
            Document("it", "Rome is the capital of Italy.")]
    tasks_file = tmp_path / "q.jsonl"
    tasks_file.write_text(json.dumps({"questions": ["capital of Germany?", "capital of Italy?"],
                                      "answers": [["Berlin"], ["Rome"]]}) + "\n")
    tasks = load_tasks_jsonl(tasks_file)
    tok = build_tokenizer([d.text for d in docs] + tasks[0].questions, kind="bpe", vocab_size=300)
    env = QAEnv(docs, tok, EnvConfig(top_k=1))
    ep = env.reset(tasks[0])
    a1 = tok.encode("<mem> </mem><search> capital Germany </search>", add_special_tokens=False)
    res = ep.step(a1)
    assert res.kind == "search" and "Berlin" in tok.decode(res.observation_ids)
    a2 = tok.encode("<mem> Berlin </mem><answer> Berlin ; rome </answer>", add_special_tokens=False)
    assert ep.step(a2).done
    tr = ep.trajectory()
    tr.validate()
    assert tr.rewards["em_sum"] == 2.0 and tr.reward == 1.0
