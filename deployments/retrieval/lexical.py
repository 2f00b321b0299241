"""The lexical half of hybrid search: chunks ranked by the query's words, in the database's
own full-text engine, so that it scales with the store as the vector index does.

- SQLite: an FTS5 table beside the chunks (rowid: the chunk's seq), its words stemmed
  (Porter: a question says "erupts" where the text says "eruption"), ranked by FTS5's
  `bm25()`; written in the same transaction as the chunks.
- PostgreSQL: the chunks' own `terms` column (`to_tsvector('english', text)`, generated
  when a chunk is written, GIN-indexed: migration 0006), ranked by `ts_rank_cd`.
A query's words are OR-ed (a question shares some words with its answer, rarely all),
less the commonest English words, which would match nearly every chunk and make the
ranking score the whole store.
"""

import re

from sqlalchemy import text
from sqlalchemy.orm import Session

from deployments.state.files import Chunk

WORD = re.compile(r"\w+", re.UNICODE)
MAX_TERMS = 64  # words of one query that count: a query is at most a few sentences
STOP = frozenset(
    WORD.findall(
        """a an and are as at be but by can could did do does for from had has have how i if
        in into is it its may might must not of on or should so than that the their them then
        there these they this those to was we were what when where which while who whom why
        will with would you your"""
    )
)
FTS = "chunk_terms"
TOKENIZER = "porter unicode61"  # FTS5's: words split on non-alphanumerics, Porter-stemmed


def terms(query: str) -> list[str]:
    seen: dict[str, None] = {}
    for word in WORD.findall(query.lower()):
        if len(word) > 1 and word not in STOP:
            seen.setdefault(word, None)
    return list(seen)[:MAX_TERMS]


def fts_match(words: list[str]) -> str:
    """An FTS5 MATCH expression: any of these words, each quoted as a plain string."""
    return " OR ".join('"' + w.replace('"', "") + '"' for w in words)


def _sqlite(s: Session) -> bool:
    return s.get_bind().dialect.name == "sqlite"


def _fts_exists(s: Session) -> bool:
    found = s.execute(text("SELECT 1 FROM sqlite_master WHERE name = :n"), {"n": FTS})
    return found.first() is not None


class LexicalIndex:
    def add(self, s: Session, store_id: str, chunks: list[Chunk]) -> None:
        if not chunks or not _sqlite(s):
            return  # PostgreSQL's terms are the chunks' own generated column
        # Made when first needed, in the transaction that writes the chunks (checked each
        # time: a table made in a transaction that rolled back is gone).
        s.execute(
            text(
                f"CREATE VIRTUAL TABLE IF NOT EXISTS {FTS} "
                f"USING fts5(text, store_id UNINDEXED, tokenize='{TOKENIZER}')"
            )
        )
        s.execute(
            text(f"INSERT INTO {FTS}(rowid, text, store_id) VALUES (:seq, :text, :store)"),
            [{"seq": c.seq, "text": c.text, "store": store_id} for c in chunks],
        )

    def delete(self, s: Session, seqs: list[int]) -> None:
        if seqs and _sqlite(s) and _fts_exists(s):
            for start in range(0, len(seqs), 500):
                marks = ",".join(str(int(q)) for q in seqs[start : start + 500])
                s.execute(text(f"DELETE FROM {FTS} WHERE rowid IN ({marks})"))

    def search(self, s: Session, store_ids: list[str], query: str, k: int) -> list[int]:
        words = terms(query)
        if not words or not store_ids:
            return []
        stores = {f"s{i}": store for i, store in enumerate(store_ids)}
        among = ",".join(f":{name}" for name in stores)
        dialect = s.get_bind().dialect.name
        if dialect == "sqlite":
            if not _fts_exists(s):
                return []  # nothing indexed yet
            match = fts_match(words)
            rows = s.execute(
                text(
                    f"SELECT rowid FROM {FTS} WHERE {FTS} MATCH :match "
                    f"AND store_id IN ({among}) ORDER BY bm25({FTS}) LIMIT :k"
                ),
                {"match": match, "k": k, **stores},
            )
        elif dialect == "postgresql":
            rows = s.execute(
                text(
                    "SELECT seq FROM chunks, to_tsquery('english', :q) query "
                    f"WHERE store_id IN ({among}) AND terms @@ query "
                    "ORDER BY ts_rank_cd(terms, query) DESC LIMIT :k"
                ),
                {"q": " | ".join(words), "k": k, **stores},
            )
        else:
            return []
        return [int(r[0]) for r in rows]
