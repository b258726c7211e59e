//! Which marks of a branch to keep under its `retain` and `thin` policy, as a pure function of the
//! branch's marks, its policy, the marks needed elsewhere and "now", so every rule can be tested
//! with fake times (the collection run in `collect` applies the verdicts to the ledger).
//!
//! For a live branch, a mark is kept when any of these holds:
//! - it is the branch's head;
//! - the policy has no `retain` (nothing is cut by count);
//! - it is among the newest `retain` of the branch's other marks (by creation time; the head takes no
//!   slot, pins count among them like any other mark);
//! - it is pinned and among the branch's newest [`PROTECTED_PINS`] pins;
//! - with `thin`, past the newest `retain`: it is the oldest mark of its calendar hour (UTC) while
//!   younger than a day, or the oldest of its UTC day while younger than 30 days. The oldest is
//!   chosen among the marks past the newest `retain` in the same tier (the head not among them), so a newer mark never
//!   displaces a keeper: a mark that stayed stays until its tier ends, and an hour's keeper goes
//!   when it crosses into the day tier unless it is also its day's oldest;
//! - it is needed elsewhere (a live branch's fork point or head, a base, a lease, a live sandbox's
//!   origin).
//!
//! A deleted branch keeps only marks needed elsewhere.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::clock::{UnixMillis, DAY_MS, HOUR_MS};
use crate::ids::MarkId;
use crate::model::RetentionPolicy;

/// How many of a branch's newest pins are protected from retention.
pub const PROTECTED_PINS: usize = 20;
/// Marks younger than this are thinned to one per calendar hour.
pub const HOUR_TIER_MS: i64 = DAY_MS;
/// Marks younger than this (and at least [`HOUR_TIER_MS`] old) are thinned to one per UTC day.
pub const DAY_TIER_MS: i64 = 30 * DAY_MS;

/// Why a mark was kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeepReason {
    /// The head of a live branch.
    Head,
    /// The branch has no `retain`: nothing is cut.
    NoLimit,
    /// Among the newest `retain` marks other than the head.
    Newest,
    /// Pinned, among the newest 20 pins.
    Pinned,
    /// The oldest of its calendar hour, younger than a day.
    HourBucket,
    /// The oldest of its UTC day, younger than 30 days.
    DayBucket,
    /// A live branch was forked at it.
    ForkPoint,
    /// A template's base.
    Base,
    /// Held by an unexpired lease.
    Lease,
    /// A live sandbox was loaded from it.
    LiveSandbox,
}

/// What retention needs to know about one mark.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarkFacts {
    pub id: MarkId,
    pub created_ms: UnixMillis,
    pub pinned: bool,
    /// Insertion order, to order marks created in the same millisecond.
    pub seq: i64,
}

/// One branch to plan.
#[derive(Debug, Clone, Copy)]
pub struct BranchInput<'a> {
    pub policy: RetentionPolicy,
    /// `false` for a deleted branch.
    pub live: bool,
    pub head: Option<&'a MarkId>,
    pub marks: &'a [MarkFacts],
}

/// The verdict on one mark: kept (with every reason that applies) or deleted (no reasons).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub id: MarkId,
    pub reasons: Vec<KeepReason>,
}

impl Verdict {
    pub fn keep(&self) -> bool {
        !self.reasons.is_empty()
    }
}

/// Decides every mark of one branch. `elsewhere` names marks needed outside the branch's own
/// policy, with why. The verdicts come newest first.
pub fn plan_branch(
    branch: BranchInput<'_>,
    elsewhere: &HashMap<MarkId, Vec<KeepReason>>,
    now: UnixMillis,
) -> Vec<Verdict> {
    let mut order: Vec<&MarkFacts> = branch.marks.iter().collect();
    order.sort_by_key(|m| std::cmp::Reverse((m.created_ms, m.seq)));

    let mut verdicts: Vec<Verdict> = order
        .iter()
        .map(|m| {
            let mut reasons = elsewhere.get(&m.id).cloned().unwrap_or_default();
            if branch.live && branch.head == Some(&m.id) {
                reasons.push(KeepReason::Head);
            }
            Verdict { id: m.id.clone(), reasons }
        })
        .collect();

    if branch.live {
        let policy = branch.policy;
        let retain = policy.retain.map(|n| n as usize);
        let mut pins = 0usize;
        // (tier reason, bucket) -> index in `order` of the oldest candidate seen so far.
        let mut keepers: BTreeMap<(KeepReason, i64), usize> = BTreeMap::new();
        // Rank among the branch's marks other than its head: the head is kept on its own and
        // takes no `retain` slot (keep the head, and of the other marks the newest `retain`).
        let mut rank = 0usize;
        for (i, m) in order.iter().enumerate() {
            let reasons = &mut verdicts[i].reasons;
            let is_head = branch.head == Some(&m.id);
            if !is_head {
                rank += 1;
            }
            match retain {
                None => reasons.push(KeepReason::NoLimit),
                Some(_) if is_head => {}
                Some(n) if rank <= n => reasons.push(KeepReason::Newest),
                Some(_) if policy.thin => {
                    let age = now.saturating_sub(m.created_ms);
                    let tier = if age < HOUR_TIER_MS {
                        Some((KeepReason::HourBucket, m.created_ms.div_euclid(HOUR_MS)))
                    } else if age < DAY_TIER_MS {
                        Some((KeepReason::DayBucket, m.created_ms.div_euclid(DAY_MS)))
                    } else {
                        None
                    };
                    if let Some(key) = tier {
                        // Newest first, so a later index in the same bucket is older.
                        keepers.insert(key, i);
                    }
                }
                Some(_) => {}
            }
            if m.pinned {
                if pins < PROTECTED_PINS {
                    reasons.push(KeepReason::Pinned);
                }
                pins += 1;
            }
        }
        for ((reason, _), i) in keepers {
            verdicts[i].reasons.push(reason);
        }
    }
    for v in &mut verdicts {
        v.reasons.sort();
        v.reasons.dedup();
    }
    verdicts
}
