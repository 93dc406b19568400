"""Seeded request streams for routing experiments (pure: no I/O, no clock).

* ``rag``: a system prompt, one of ``documents`` documents picked with Zipf popularity
  (exponent ``zipf_s``), and a unique question; chat format.
* ``chat``: multi-turn conversations; each turn resends the whole history plus a new
  user message; a turn may only start after the previous turn of its conversation
  (``WorkItem.after``).
* ``templated``: a few long assistant templates (Zipf-popular) with a short user input;
  completions format.
* ``unique``: prompts that share nothing (the negative control).
* ``aws-8k``: the published SageMaker setting: ``families`` document families, each an
  ``prefix_tokens``-token shared system prompt (8,000), picked with Zipf exponent
  ``zipf_s`` (0: uniform), and a short unique user question (``suffix_tokens``, 100);
  chat format. Token counts are exact under the simulated engine's tokenizer.
* ``code``: code completion over ``repos`` repositories (Zipf-popular): a shared
  repository context (``context_chars``), then one of ``files`` files (Zipf-popular)
  cut at a random cursor; completions format, short outputs.
* ``sglang-gsp``: SGLang's "generated shared prefix" benchmark shape (``bench_serving
  --dataset-name generated-shared-prefix``; the dataset of sgl-project/sglang
  docs/benchmark/benchmark.md: 4,096 prompts in 128 groups, a shared system prompt of
  ~2,138 tokens per group, questions of ~535 tokens, 256 output tokens), prompts of all
  groups shuffled; uniform group popularity, one turn.
* ``llmd-b2b``: llm-d's precise prefix-cache-aware scheduling benchmark shape (the
  llm-d blog "KV-Cache Wins You Can See", 2025: 150 enterprise customers, each with a
  6,000-token context, 5 users per customer, 1,200-token queries): each request is one
  customer's context (system message) and one of its users' query; customers and users
  uniform. The blog sizes it at 73 % of 8 pods' KV cache; scale ``customers`` and the
  token counts down for small engines (e.g. ``--set customers=20``).

The fleet simulator (``preheat sim routing --workload NAME``) and the live benchmarks
draw from the same ``WORKLOADS`` registry.

Every generator takes ``seed``; the same arguments give the same stream, byte for byte.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from preheat.errors import ConfigError

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class WorkItem:
    """One request of a workload: where to send it, the body, and its sharing group."""

    request_id: str
    path: str
    body: dict[str, Any]
    group: str
    after: str | None = None


_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "shi", "pe", "da", "xu", "zen", "or")


def _vocab(seed: int, size: int = 3000) -> list[str]:
    rng = random.Random(seed ^ 0x5EED)
    return ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(size)]


def text(rng: random.Random, chars: int, vocab: list[str]) -> str:
    """Pseudo-words up to ``chars`` characters."""
    out: list[str] = []
    n = 0
    while n < chars:
        w = vocab[rng.randrange(len(vocab))]
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def zipf_weights(k: int, s: float) -> list[float]:
    """Popularity of ranks 1..k under Zipf's law with exponent ``s`` (normalised)."""
    w = [1.0 / (i**s) for i in range(1, k + 1)]
    total = sum(w)
    return [x / total for x in w]


def _check(n: int, name: str) -> None:
    if n < 1:
        raise ConfigError(f"{name} {n} must be at least 1")


def rag(
    n: int,
    *,
    documents: int = 60,
    doc_chars: int = 8000,
    question_chars: int = 200,
    zipf_s: float = 1.1,
    max_tokens: int = 32,
    seed: int = 0,
) -> list[WorkItem]:
    """Questions over documents with skewed popularity (hot documents)."""
    _check(n, "n")
    _check(documents, "documents")
    vocab = _vocab(seed)
    rng = random.Random(seed)
    system = "You answer questions using only the document. " + text(rng, 400, vocab)
    docs = [f"Document {d}:\n" + text(rng, doc_chars, vocab) for d in range(documents)]
    picks = rng.choices(range(documents), weights=zipf_weights(documents, zipf_s), k=n)
    out = []
    for i, d in enumerate(picks):
        q = text(rng, question_chars, vocab)
        body = {
            "model": "m",
            "max_tokens": max_tokens,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"{docs[d]}\n\nQuestion {i}: {q}"},
            ],
        }
        out.append(WorkItem(f"rag-{seed}-{i}", CHAT, body, f"doc{d}"))
    return out


def chat(
    n: int,
    *,
    active: int = 32,
    turns: int = 6,
    system_chars: int = 1500,
    user_chars: int = 500,
    reply_chars: int = 700,
    max_tokens: int = 32,
    seed: int = 0,
) -> list[WorkItem]:
    """Interleaved multi-turn conversations (``active`` at a time, ``turns`` each)."""
    _check(n, "n")
    _check(active, "active")
    vocab = _vocab(seed)
    rng = random.Random(seed)
    system = "You are a helpful assistant. " + text(rng, system_chars, vocab)
    convs: list[dict[str, Any]] = []
    next_conv = 0
    out: list[WorkItem] = []

    def new() -> dict[str, Any]:
        nonlocal next_conv
        c = {"id": next_conv, "turn": 0, "msgs": [{"role": "system", "content": system}]}
        next_conv += 1
        return c

    convs = [new() for _ in range(active)]
    last: dict[int, str] = {}
    for i in range(n):
        c = convs[rng.randrange(len(convs))]
        msgs = c["msgs"]
        msgs.append({"role": "user", "content": text(rng, user_chars, vocab)})
        rid = f"chat-{seed}-{i}"
        body = {"model": "m", "max_tokens": max_tokens, "messages": [dict(m) for m in msgs]}
        out.append(WorkItem(rid, CHAT, body, f"conv{c['id']}", after=last.get(c["id"])))
        last[c["id"]] = rid
        msgs.append({"role": "assistant", "content": text(rng, reply_chars, vocab)})
        c["turn"] += 1
        if c["turn"] >= turns:
            convs[convs.index(c)] = new()
    return out


def templated(
    n: int,
    *,
    templates: int = 8,
    template_chars: int = 6000,
    user_chars: int = 300,
    zipf_s: float = 1.2,
    max_tokens: int = 32,
    seed: int = 0,
) -> list[WorkItem]:
    """A templated assistant: long shared instructions + a short user input."""
    _check(n, "n")
    _check(templates, "templates")
    vocab = _vocab(seed)
    rng = random.Random(seed)
    tpls = [f"Template {t}. " + text(rng, template_chars, vocab) for t in range(templates)]
    picks = rng.choices(range(templates), weights=zipf_weights(templates, zipf_s), k=n)
    out = []
    for i, t in enumerate(picks):
        prompt = f"{tpls[t]}\n\nInput {i}: {text(rng, user_chars, vocab)}\nOutput:"
        body = {"model": "m", "max_tokens": max_tokens, "prompt": prompt}
        out.append(WorkItem(f"tpl-{seed}-{i}", COMPLETIONS, body, f"tpl{t}"))
    return out


def unique(n: int, *, chars: int = 6000, max_tokens: int = 32, seed: int = 0) -> list[WorkItem]:
    """Prompts that share no prefix (beyond a few characters)."""
    _check(n, "n")
    vocab = _vocab(seed)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = f"{i:08d} {text(rng, chars, vocab)}"
        body = {"model": "m", "max_tokens": max_tokens, "prompt": prompt}
        out.append(WorkItem(f"uniq-{seed}-{i}", COMPLETIONS, body, f"u{i}"))
    return out


def _word_tokens(word: str, lead: bool) -> int:
    # The simulated tokenizer cuts a word piece (with its leading space) into chunks of
    # at most 6 characters (engine/core/tokenizer.py); a letters-only word is one piece.
    return -(-(len(word) + lead) // 6)


def text_tokens(rng: random.Random, tokens: int, vocab: list[str]) -> str:
    """Pseudo-words that are exactly ``tokens`` tokens for the simulated tokenizer."""
    out: list[str] = []
    n = 0
    while n < tokens:
        w = vocab[rng.randrange(len(vocab))]
        k = _word_tokens(w, bool(out))
        if n + k > tokens:
            w = w[: 5 if out else 6]  # one token: at most 6 characters with the space
            k = 1
        out.append(w)
        n += k
    return " ".join(out)


def aws_8k(
    n: int,
    *,
    families: int = 100,
    prefix_tokens: int = 8000,
    suffix_tokens: int = 100,
    zipf_s: float = 0.0,
    max_tokens: int = 64,
    seed: int = 0,
) -> list[WorkItem]:
    """SageMaker's prefix-routing benchmark shape: per document family an 8,000-token
    shared prefix (the system message) and a short unique question."""
    _check(n, "n")
    _check(families, "families")
    _check(prefix_tokens, "prefix_tokens")
    _check(suffix_tokens, "suffix_tokens")
    vocab = _vocab(seed)
    rng = random.Random(seed)
    prefixes = [text_tokens(rng, prefix_tokens, vocab) for _ in range(families)]
    w = zipf_weights(families, zipf_s)
    picks = rng.choices(range(families), weights=w, k=n)
    out = []
    for i, f in enumerate(picks):
        body = {
            "model": "m",
            "max_tokens": max_tokens,
            "messages": [
                {"role": "system", "content": prefixes[f]},
                {"role": "user", "content": text_tokens(rng, suffix_tokens, vocab)},
            ],
        }
        out.append(WorkItem(f"aws-{seed}-{i}", CHAT, body, f"family{f}"))
    return out


def code(
    n: int,
    *,
    repos: int = 4,
    files: int = 40,
    context_chars: int = 4000,
    file_chars: int = 6000,
    zipf_s: float = 1.1,
    max_tokens: int = 16,
    seed: int = 0,
) -> list[WorkItem]:
    """Code completion: repository context, then a file cut at a random cursor."""
    _check(n, "n")
    _check(repos, "repos")
    _check(files, "files")
    vocab = _vocab(seed)
    rng = random.Random(seed)
    ctx = [f"# repository {r}\n" + text(rng, context_chars, vocab) for r in range(repos)]
    src = [
        [f"\n# file {r}/{f}.py\n" + text(rng, file_chars, vocab) for f in range(files)]
        for r in range(repos)
    ]
    rw = zipf_weights(repos, zipf_s)
    fw = zipf_weights(files, zipf_s)
    out = []
    for i in range(n):
        r = rng.choices(range(repos), weights=rw)[0]
        f = rng.choices(range(files), weights=fw)[0]
        cursor = rng.randrange(file_chars // 4, file_chars)
        body = {"model": "m", "max_tokens": max_tokens, "prompt": ctx[r] + src[r][f][:cursor]}
        out.append(WorkItem(f"code-{seed}-{i}", COMPLETIONS, body, f"repo{r}/file{f}"))
    return out


def _shared(seed: int, group: int, tokens: int, vocab: list[str]) -> str:
    """Group ``group``'s shared prefix: its own seeded stream, made only when used."""
    rng = random.Random(seed * 1_000_003 + group)
    return f"Group {group}. " + text_tokens(rng, tokens, vocab)


def sglang_gsp(
    n: int,
    *,
    groups: int = 128,
    system_tokens: int = 2138,
    question_tokens: int = 535,
    max_tokens: int = 256,
    seed: int = 0,
) -> list[WorkItem]:
    """SGLang's generated-shared-prefix shape: groups of prompts that share a system
    prompt, shuffled across groups (see the module docstring for the source)."""
    _check(n, "n")
    _check(groups, "groups")
    vocab = _vocab(seed)
    rng = random.Random(seed)
    picks = [i % groups for i in range(n)]
    rng.shuffle(picks)
    made: dict[int, str] = {}
    out = []
    for i, g in enumerate(picks):
        body = {
            "model": "m",
            "max_tokens": max_tokens,
            "messages": [
                {
                    "role": "system",
                    "content": made.get(g)
                    or made.setdefault(g, _shared(seed, g, system_tokens, vocab)),
                },
                {"role": "user", "content": text_tokens(rng, question_tokens, vocab)},
            ],
        }
        out.append(WorkItem(f"gsp-{seed}-{i}", CHAT, body, f"group{g}"))
    return out


def llmd_b2b(
    n: int,
    *,
    customers: int = 150,
    context_tokens: int = 6000,
    users: int = 5,
    query_tokens: int = 1200,
    max_tokens: int = 64,
    seed: int = 0,
) -> list[WorkItem]:
    """llm-d's B2B shape: a per-customer context shared by that customer's users, and a
    long query per request (see the module docstring for the source)."""
    _check(n, "n")
    _check(customers, "customers")
    _check(users, "users")
    vocab = _vocab(seed)
    rng = random.Random(seed)
    made: dict[int, str] = {}
    out = []
    for i in range(n):
        c = rng.randrange(customers)
        u = rng.randrange(users)
        query = f"User {u}: " + text_tokens(rng, query_tokens, vocab)
        body = {
            "model": "m",
            "max_tokens": max_tokens,
            "messages": [
                {
                    "role": "system",
                    "content": made.get(c)
                    or made.setdefault(c, _shared(seed, c, context_tokens, vocab)),
                },
                {"role": "user", "content": query},
            ],
        }
        out.append(WorkItem(f"b2b-{seed}-{i}", CHAT, body, f"customer{c}/user{u}"))
    return out


#: The share of each workload in ``mixed`` traffic.
MIX: dict[str, float] = {"rag": 0.3, "chat": 0.3, "templated": 0.2, "unique": 0.2}


def mixed(
    n: int,
    *,
    weights: dict[str, float] | None = None,
    doc_chars: int = 4000,
    unique_chars: int = 2000,
    max_tokens: int = 16,
    seed: int = 0,
) -> list[WorkItem]:
    """RAG, multi-turn chat, templated and unique requests interleaved at random by
    ``weights`` (default ``MIX``); each workload keeps its own order (a chat turn still
    comes after the turn it extends)."""
    _check(n, "n")
    w = dict(MIX if weights is None else weights)
    unknown = sorted(set(w) - {"rag", "chat", "templated", "unique"})
    if unknown or not any(v > 0 for v in w.values()):
        raise ConfigError(
            f"mixed weights {w} need positive shares of rag, chat, templated, unique "
            f"(unknown: {unknown})"
        )
    rng = random.Random(seed)
    kinds = list(w)
    slots = rng.choices(kinds, weights=[w[k] for k in kinds], k=n)
    counts = {k: slots.count(k) for k in kinds}
    made: dict[str, list[WorkItem]] = {}
    for k, c in counts.items():
        if c == 0:
            continue
        if k == "rag":
            made[k] = rag(c, documents=30, doc_chars=doc_chars, max_tokens=max_tokens, seed=seed)
        elif k == "chat":
            made[k] = chat(c, active=8, turns=4, max_tokens=max_tokens, seed=seed)
        elif k == "templated":
            made[k] = templated(c, max_tokens=max_tokens, seed=seed)
        else:
            made[k] = unique(c, chars=unique_chars, max_tokens=max_tokens, seed=seed)
    streams = {k: iter(v) for k, v in made.items()}
    return [next(streams[k]) for k in slots]


WORKLOADS: dict[str, Callable[..., list[WorkItem]]] = {
    "rag": rag,
    "chat": chat,
    "templated": templated,
    "unique": unique,
    "mixed": mixed,
    "aws-8k": aws_8k,
    "code": code,
    "sglang-gsp": sglang_gsp,
    "llmd-b2b": llmd_b2b,
}


# --- KV-memory pressure shapes (router benchmarks, issue 14; kvroute) -------------------


def rag_chat(n: int, *, max_tokens: int = 16, seed: int = 0) -> list[WorkItem]:
    """Skewed RAG (30 documents of 4,000 characters) and multi-turn chat, half each:
    a prefix working set larger than one engine's KV cache at 600 blocks."""
    return mixed(n, weights={"rag": 0.5, "chat": 0.5}, max_tokens=max_tokens, seed=seed)


#: The router benchmarks' name for ``code`` (same shape: repository context, then a
#: Zipf-popular file cut at a random cursor).
code_completion = code


WORKLOADS["rag_chat"] = rag_chat
WORKLOADS["code_completion"] = code_completion
