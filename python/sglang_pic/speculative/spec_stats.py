"""Counters of speculative decoding: per request (reported in meta_info) and for the whole engine.

Acceptance length is what speculation buys: tokens committed per verification forward (1.0 = no gain). The time
split and the bytes streamed from the host tier say what it costs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


def accept_length(committed_tokens: int, verify_ct: int) -> float:
    """Tokens committed per verification (0.0 before any)."""
    return committed_tokens / verify_ct if verify_ct else 0.0


def accept_rate(accepted_drafts: int, draft_tokens: int) -> float:
    """Share of drafted tokens that verification accepted (0.0 before any)."""
    return accepted_drafts / draft_tokens if draft_tokens else 0.0


@dataclass
class ReqSpecStats:
    """One request's speculation record; attached to the request as `req.spec_stats`."""

    verify_ct: int = 0  # verification forwards (rounds) the request took part in
    draft_tokens: int = 0  # tokens drafted for it
    accepted_drafts: int = 0  # drafted tokens that verification accepted
    committed_tokens: int = 0  # tokens output by its rounds (accepted drafts + one correction/bonus per round)

    def record(self, drafted: int, accepted: int, committed: int) -> None:
        self.verify_ct += 1
        self.draft_tokens += drafted
        self.accepted_drafts += accepted
        self.committed_tokens += committed

    def to_meta(self) -> dict[str, float | int]:
        return {
            "spec_verify_ct": self.verify_ct,
            "spec_accept_length": accept_length(self.committed_tokens, self.verify_ct),
            "spec_accept_rate": accept_rate(self.accepted_drafts, self.draft_tokens),
        }


@dataclass
class SpecStats:
    """Engine-wide totals since start."""

    rounds: int = 0  # draft+verify rounds over the running requests
    verify_batches: int = 0  # verification forwards (one per round, or one per group with staggered rounds)
    verify_ct: int = 0  # request-rounds
    draft_tokens: int = 0
    accepted_drafts: int = 0
    committed_tokens: int = 0
    draft_builds: int = 0  # draft caches built or rebuilt (compressions)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    build_time_s: float = 0.0
    h2d_bytes: int = 0  # host tier -> device (verification staging, draft rebuilds)
    d2h_bytes: int = 0  # device -> host tier (offload after prefill, verified tokens)

    def to_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = asdict(self)
        out["accept_length"] = accept_length(self.committed_tokens, self.verify_ct)
        out["accept_rate"] = accept_rate(self.accepted_drafts, self.draft_tokens)
        return out
