"""A request's speculative decoding in words (`lumen trace why`): the drafts its steps verified
and kept, what the proposer cost it, and what the refused drafts cost the verifying passes.

From the steps table (migration 12): ``num_drafted`` and ``num_accepted`` per request row,
``propose_ns`` per step. Shares of a step are by its rows: the proposer's time over the rows
that took part, a verifying pass's forward over its tokens (a refused draft's share is one
token's). These are estimates from the step's own split, said as such.
"""

from __future__ import annotations

import duckdb

from tracing.words import ms

# Kept drafts at or under this share of those verified read as low acceptance.
LOW_ACCEPTANCE = 0.3

_SQL = """
WITH mine AS (
    SELECT request_id AS core_id FROM requests WHERE run_id = $run AND request_id = $req
    UNION SELECT core_id FROM request_children WHERE run_id = $run AND request_id = $req
), rows AS (
    SELECT s.step_id, s.propose_ns, s.execute_end_ns - s.execute_start_ns AS execute_ns,
        s.num_scheduled_tokens AS step_tokens, len(s.request_ids) AS step_rows,
        unnest(s.request_ids) AS core_id, unnest(s.num_scheduled) AS tokens,
        unnest(s.num_drafted) AS drafted, unnest(s.num_accepted) AS kept
    FROM steps s WHERE s.run_id = $run AND NOT coalesce(s.idle, false)
)
SELECT count(*) FILTER (WHERE drafted > 0), coalesce(sum(drafted), 0)::BIGINT,
    coalesce(sum(kept), 0)::BIGINT,
    coalesce(sum(coalesce(propose_ns, 0) / step_rows), 0),
    coalesce(sum(CASE WHEN drafted > 0 THEN (execute_ns - coalesce(propose_ns, 0))
        * (drafted - kept) / greatest(step_tokens, 1) END), 0),
    max(propose_ns) IS NOT NULL
FROM rows JOIN mine USING (core_id)
"""


def sentences(con: duckdb.DuckDBPyConnection, run_id: str, request_id: str) -> list[str]:
    """What speculation did for the request; none where its run did not speculate."""
    have = {c for (c,) in con.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = 'steps'"
    ).fetchall()}  # fmt: skip
    if "num_drafted" not in have:
        return []
    row = con.execute(_SQL, {"run": run_id, "req": request_id}).fetchone()
    if row is None:
        return []
    steps, drafted, kept, propose_ns, refused_ns, proposed = row
    if not steps and not proposed:
        return []
    if not steps:
        return ["Speculative decoding was on, but none of its steps verified drafts (none "
                "matched, or the batch was over disable_by_batch_size)."]  # fmt: skip
    rate = kept / drafted if drafted else 0.0
    out = [
        f"Speculative decoding: {steps} of its steps verified {drafted} drafts and kept {kept} "
        f"({rate:.0%}), {1 + kept / steps:.1f} tokens a verifying step. Its share of the "
        f"proposer's time was {ms(propose_ns)}; the {drafted - kept} refused drafts took about "
        f"{ms(refused_ns)} of the verifying passes (their share of each pass's tokens), thrown "
        "away."
    ]
    if rate <= LOW_ACCEPTANCE:
        out.append(
            f"Low acceptance ({rate:.0%}): most drafts were refused, so the verifying passes "
            "and the proposer bought it few tokens. A proposer closer to the model (a draft "
            "model for open text, ngram for answers that copy the prompt), a smaller "
            "num_speculative_tokens or a lower disable_by_batch_size would waste less."
        )
    return out
