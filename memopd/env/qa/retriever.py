"""BM25 retrieval over a corpus of `Document`s (the environment's search tool).

Documents are indexed as "title : text" (`Document.display`).

Built on `bm25s` (Lucene BM25 variant, English stop words removed). Results are the
top-k documents with a positive score, ordered by score and, on ties, by corpus order,
so a search is deterministic. A query with no known word returns no documents.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .data import DataError, Document

__all__ = ["BM25Retriever"]


class BM25Retriever:
    def __init__(self, documents: Sequence[Document], *, top_k: int = 3, k1: float = 1.5, b: float = 0.75):
        import bm25s

        if not documents:
            raise DataError("cannot index an empty corpus")
        if top_k < 1:
            raise DataError(f"top_k must be >= 1, got {top_k}")
        self.documents = list(documents)
        self.top_k = int(top_k)
        self._bm25s = bm25s
        self._index = bm25s.BM25(k1=k1, b=b)
        # Index the title with the text: a document about X names X twice, so it outranks
        # documents that only mention X.
        corpus_tokens = bm25s.tokenize([d.display for d in self.documents], stopwords="en", show_progress=False)
        self._index.index(corpus_tokens, show_progress=False)
        self._by_id = {d.id: i for i, d in enumerate(self.documents)}

    def scores(self, query: str) -> np.ndarray:
        # return_ids=False: words, looked up in the index vocabulary (unknown words drop out).
        words = self._bm25s.tokenize([query], stopwords="en", show_progress=False, return_ids=False)[0]
        if not words:
            return np.zeros(len(self.documents), dtype=np.float32)
        return np.asarray(self._index.get_scores(words))

    def search_indices(self, query: str, k: int | None = None) -> list[int]:
        k = self.top_k if k is None else int(k)
        s = self.scores(query)
        if len(s) > 50000:
            cand = np.argpartition(-s, min(k, len(s) - 1))[: k + 1]
            cand = cand[np.lexsort((cand, -s[cand]))]
        else:
            cand = np.lexsort((np.arange(len(s)), -s))  # score desc, then corpus order
        return [int(i) for i in cand[:k] if s[i] > 0]

    def search(self, query: str, k: int | None = None) -> list[Document]:
        return [self.documents[i] for i in self.search_indices(query, k)]

    def rank_of(self, query: str, doc_id: str, k: int | None = None) -> int | None:
        """0-based rank of `doc_id` in the top-k of `query`, or None if absent."""
        idx = self.search_indices(query, k)
        j = self._by_id.get(doc_id)
        return idx.index(j) if j in idx else None
