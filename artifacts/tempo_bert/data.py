"""A real English corpus that needs no network, and BERT / GPT-2 training batches made from it.

The corpus is the docstrings of the Python standard library installed on this machine (parsed
with ``ast``, nothing imported): several MB of English prose about programs. A WordPiece
tokenizer (BERT) and a byte-level BPE (GPT-2) are trained on it with the ``tokenizers`` library;
BERT batches are sentence pairs for next-sentence prediction (half true successors, half random)
with the standard MLM masking (15% of tokens: 80% [MASK], 10% random, 10% kept); GPT-2 batches
are contiguous blocks of the token stream. Everything built is cached under ``cache_dir``.

``source`` picks another corpus: a HuggingFace ``datasets`` one (wikitext-103, wikitext-2;
optional extra ``[data]``, network needed the first time), with a clear error when it cannot
be had.
"""

from __future__ import annotations

import ast
import json
import re
import sysconfig
from pathlib import Path

import torch

DEFAULT_CACHE = Path(__file__).resolve().parents[2] / "data-cache"
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return []
    nodes = [
        tree,
        *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef)),
    ]
    return [d for n in nodes if (d := ast.get_docstring(n))]


def stdlib_documents(min_sentences: int = 2) -> list[list[str]]:
    """Documents (lists of sentences) from the standard library's docstrings, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        for text in _docstrings(path):
            prose = " ".join(
                line.strip() for line in text.splitlines() if line.strip() and not line.startswith(">>>")
            )
            sentences = [s for s in _SENTENCE_END.split(prose) if len(s.split()) >= 3]
            if len(sentences) >= min_sentences:
                docs.append(sentences)
    if not docs:
        raise RuntimeError(f"no docstrings found under {root}: cannot build the offline corpus")
    return docs


# Hugging Face ``datasets`` corpora the --corpus option accepts: name -> (path, config).
HF_CORPORA = {
    "wikitext-103": ("Salesforce/wikitext", "wikitext-103-raw-v1"),
    "wikitext-2": ("Salesforce/wikitext", "wikitext-2-raw-v1"),
}
CORPORA = ("stdlib", *HF_CORPORA)
HF_MAX_DOCUMENTS = 20_000  # plenty for a few hundred steps; keeps the cache small


def hf_documents(name: str, max_documents: int = HF_MAX_DOCUMENTS) -> list[list[str]]:
    """Documents (lists of sentences) of a wikitext corpus's train split, via ``datasets``."""
    try:
        import datasets
    except ImportError:
        raise RuntimeError(
            f"--corpus {name} needs the `datasets` library: pip install -e '.[data]' "
            "(or use the default offline corpus, --corpus stdlib)"
        ) from None
    path, config = HF_CORPORA[name]
    try:
        rows = datasets.load_dataset(path, config, split="train")
    except Exception as e:  # no network, hub down, offline mode: all end here
        raise RuntimeError(
            f"could not load {name} ({path}, {config}) with `datasets`: {type(e).__name__}: {e}. "
            "It needs network access the first time (then it is cached); without it use the "
            "default offline corpus (--corpus stdlib)."
        ) from e
    docs: list[list[str]] = []
    current: list[str] = []
    for line in rows["text"]:
        line = line.strip()
        if line.startswith("= ") and not line.startswith("= = "):  # a new article's title
            if len(current) >= 2:
                docs.append(current)
                if len(docs) >= max_documents:
                    break
            current = []
        elif line and not line.startswith("="):
            current.extend(s for s in _SENTENCE_END.split(line) if len(s.split()) >= 3)
    if len(current) >= 2 and len(docs) < max_documents:
        docs.append(current)
    return docs


def corpus(cache_dir: Path = DEFAULT_CACHE, source: str = "stdlib") -> list[list[str]]:
    """The documents of ``source`` ('stdlib', offline; or a HF_CORPORA name), built once and cached."""
    if source not in CORPORA:
        raise ValueError(f"corpus must be one of {CORPORA}, got {source!r}")
    path = cache_dir / ("stdlib_docstrings.json" if source == "stdlib" else f"{source}.json")
    if not path.exists():
        docs = stdlib_documents() if source == "stdlib" else hf_documents(source)
        cache_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(docs))
    return json.loads(path.read_text())


def tokenizer(kind: str, vocab_size: int = 8192, cache_dir: Path = DEFAULT_CACHE, source: str = "stdlib"):
    """A trained (and cached) ``tokenizers`` tokenizer: kind 'wordpiece' (BERT) or 'bpe' (GPT-2)."""
    from tokenizers import ByteLevelBPETokenizer, Tokenizer
    from tokenizers.implementations import BertWordPieceTokenizer

    prefix = "" if source == "stdlib" else f"{source}-"  # the stdlib names predate --corpus
    path = cache_dir / f"{prefix}{kind}-{vocab_size}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    texts = (" ".join(doc) for doc in corpus(cache_dir, source))
    if kind == "wordpiece":
        tok = BertWordPieceTokenizer(lowercase=True)
        tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2)
    elif kind == "bpe":
        tok = ByteLevelBPETokenizer()
        tok.train_from_iterator(
            texts, vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"]
        )
    else:
        raise ValueError(f"tokenizer kind must be 'wordpiece' or 'bpe', got {kind!r}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return Tokenizer.from_file(str(path))


def fingerprint(kind: str, cache_dir: Path = DEFAULT_CACHE, source: str = "stdlib") -> dict[str, str]:
    """sha256 of the corpus and the tokenizer a run trained on: both are built on this machine
    (the stdlib's docstrings differ between Python versions, and training a WordPiece tokenizer
    is not deterministic), so a result records which ones it used."""
    import hashlib

    tokenizer(kind, cache_dir=cache_dir, source=source)  # built (and cached) if it is not yet
    prefix = "" if source == "stdlib" else f"{source}-"
    files = {
        "corpus": cache_dir / ("stdlib_docstrings.json" if source == "stdlib" else f"{source}.json"),
        "tokenizer": cache_dir / f"{prefix}{kind}-8192.json",
    }
    return {
        f"{name}_sha256": hashlib.sha256(path.read_bytes()).hexdigest()[:16] for name, path in files.items()
    }


def bert_batches(
    n_batches: int, batch: int, seq: int, seed: int, cache_dir: Path = DEFAULT_CACHE, source: str = "stdlib"
) -> list[dict]:
    """MLM + NSP batches for BertForPreTraining, deterministic in ``seed``."""
    tok = tokenizer("wordpiece", cache_dir=cache_dir, source=source)
    cls_id, sep_id, mask_id, pad_id = (tok.token_to_id(t) for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]"))
    vocab = tok.get_vocab_size()
    docs = corpus(cache_dir, source)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        ids = torch.full((batch, seq), pad_id, dtype=torch.long)
        types = torch.zeros(batch, seq, dtype=torch.long)
        attn = torch.zeros(batch, seq, dtype=torch.long)
        nsp = torch.zeros(batch, dtype=torch.long)
        for row in range(batch):
            doc = docs[int(torch.randint(len(docs), (1,), generator=g))]
            i = int(torch.randint(len(doc) - 1, (1,), generator=g))
            a = tok.encode(doc[i], add_special_tokens=False).ids
            if torch.rand((), generator=g) < 0.5:  # true next sentence
                b = tok.encode(doc[i + 1], add_special_tokens=False).ids
            else:  # a random sentence from a random document
                other = docs[int(torch.randint(len(docs), (1,), generator=g))]
                b = tok.encode(
                    other[int(torch.randint(len(other), (1,), generator=g))], add_special_tokens=False
                ).ids
                nsp[row] = 1
            while len(a) + len(b) > seq - 3:  # BERT's truncate_seq_pair: trim the longer one
                (a if len(a) >= len(b) else b).pop()
            tokens = [cls_id, *a, sep_id, *b, sep_id]
            ids[row, : len(tokens)] = torch.tensor(tokens)
            types[row, len(a) + 2 : len(tokens)] = 1
            attn[row, : len(tokens)] = 1
        special = (ids == cls_id) | (ids == sep_id) | (ids == pad_id)
        chosen = (torch.rand(ids.shape, generator=g) < 0.15) & ~special
        labels = torch.where(chosen, ids, torch.full_like(ids, -100))
        roll = torch.rand(ids.shape, generator=g)
        masked = ids.clone()
        masked[chosen & (roll < 0.8)] = mask_id
        random_pos = chosen & (roll >= 0.8) & (roll < 0.9)
        masked[random_pos] = torch.randint(vocab, (int(random_pos.sum()),), generator=g)
        out.append(
            {
                "input_ids": masked,
                "token_type_ids": types,
                "attention_mask": attn,
                "labels": labels,
                "next_sentence_label": nsp,
            }
        )
    return out


def gpt2_batches(
    n_batches: int, batch: int, seq: int, seed: int, cache_dir: Path = DEFAULT_CACHE, source: str = "stdlib"
) -> list[dict]:
    """Language-modelling blocks of the BPE token stream, deterministic in ``seed``."""
    tok = tokenizer("bpe", cache_dir=cache_dir, source=source)
    eot = tok.token_to_id("<|endoftext|>")
    stream: list[int] = []
    for doc in corpus(cache_dir, source):
        stream.extend(tok.encode(" ".join(doc)).ids)
        stream.append(eot)
        if len(stream) > 4 * n_batches * batch * seq:
            break
    data = torch.tensor(stream)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        starts = torch.randint(len(data) - seq, (batch,), generator=g)
        ids = torch.stack([data[s : s + seq] for s in starts.tolist()])
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out
