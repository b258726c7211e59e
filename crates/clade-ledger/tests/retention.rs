//! The retention rules, table-driven with fake times (the pure planner), then a simulated month of
//! marks every ten minutes checking that a keeper is only ever let go as it crosses a tier.

use std::collections::{BTreeSet, HashMap};

use clade_ledger::clock::{DAY_MS, HOUR_MS, MINUTE_MS};
use clade_ledger::retention::{plan_branch, BranchInput, KeepReason, MarkFacts, PROTECTED_PINS};
use clade_ledger::{MarkId, RetentionPolicy};

/// Midnight UTC of some day in 2026; "now" in the table is D0 + 12:30.
const D0: i64 = 20_424 * DAY_MS;
const NOW: i64 = D0 + 12 * HOUR_MS + 30 * MINUTE_MS;

/// A time `d` days before D0 (0 = today) at `h:m` UTC.
const fn at(d: i64, h: i64, m: i64) -> i64 {
    D0 - d * DAY_MS + h * HOUR_MS + m * MINUTE_MS
}

struct Case {
    name: &'static str,
    policy: RetentionPolicy,
    live: bool,
    /// (label, created, pinned)
    marks: Vec<(&'static str, i64, bool)>,
    head: Option<&'static str>,
    elsewhere: Vec<(&'static str, KeepReason)>,
    keep: Vec<&'static str>,
}

fn facts(marks: &[(&'static str, i64, bool)]) -> Vec<MarkFacts> {
    marks
        .iter()
        .enumerate()
        .map(|(i, (l, t, p))| MarkFacts { id: MarkId::new(*l), created_ms: *t, pinned: *p, seq: i as i64 })
        .collect()
}

fn plan(c: &Case, now: i64) -> Vec<(String, Vec<KeepReason>)> {
    let marks = facts(&c.marks);
    let head = c.head.map(MarkId::new);
    let mut elsewhere: HashMap<MarkId, Vec<KeepReason>> = HashMap::new();
    for (l, r) in &c.elsewhere {
        elsewhere.entry(MarkId::new(*l)).or_default().push(*r);
    }
    let input = BranchInput { policy: c.policy, live: c.live, head: head.as_ref(), marks: &marks };
    plan_branch(input, &elsewhere, now).into_iter().map(|v| (v.id.to_string(), v.reasons)).collect()
}

fn hourly(labels: &[&'static str], from: i64) -> Vec<(&'static str, i64, bool)> {
    labels.iter().enumerate().map(|(i, l)| (*l, from + i as i64 * HOUR_MS, false)).collect()
}

fn cases() -> Vec<Case> {
    let base =
        |name, policy, marks, head, keep| Case { name, policy, live: true, marks, head, elsewhere: vec![], keep };
    let abcde = hourly(&["a", "b", "c", "d", "e"], at(0, 7, 0));
    let pins25: Vec<(&'static str, i64, bool)> = (0..25)
        .map(|i| -> (&'static str, i64, bool) {
            let l: &'static str = Box::leak(format!("p{i:02}").into_boxed_str());
            (l, at(0, 0, 0) + i * MINUTE_MS, true)
        })
        .collect();
    let pins25_keep: Vec<&'static str> = pins25[25 - PROTECTED_PINS..].iter().map(|m| m.0).collect();
    vec![
        base(
            "no retain keeps everything",
            RetentionPolicy::KEEP_ALL,
            abcde.clone(),
            Some("e"),
            vec!["a", "b", "c", "d", "e"],
        ),
        base(
            "retain 2 keeps the head and the two newest others",
            RetentionPolicy::retain(2),
            abcde.clone(),
            Some("e"),
            vec!["c", "d", "e"],
        ),
        base("retain 0 keeps only the head", RetentionPolicy::retain(0), abcde.clone(), Some("e"), vec!["e"]),
        base(
            "a retaken head is kept outside the newest",
            RetentionPolicy::retain(1),
            abcde.clone(),
            Some("b"),
            vec!["b", "e"],
        ),
        base(
            "a branch with no head and retain 0 keeps nothing",
            RetentionPolicy::retain(0),
            abcde.clone(),
            None,
            vec![],
        ),
        base(
            "an old pin survives retain",
            RetentionPolicy::retain(1),
            vec![
                ("a", at(3, 0, 0), true),
                ("b", at(2, 0, 0), false),
                ("c", at(1, 0, 0), false),
                ("d", at(0, 1, 0), false),
            ],
            Some("d"),
            vec!["a", "c", "d"],
        ),
        base("only the newest 20 pins are protected", RetentionPolicy::retain(0), pins25, None, pins25_keep),
        base(
            "pins count among the newest retain",
            RetentionPolicy::retain(2),
            vec![
                ("x", at(0, 1, 0), false),
                ("y", at(0, 2, 0), false),
                ("z", at(0, 3, 0), true),
                ("w", at(0, 4, 0), false),
            ],
            Some("w"),
            vec!["y", "z", "w"],
        ),
        base(
            "same millisecond: insertion order decides which is newer",
            RetentionPolicy::retain(1),
            vec![("first", at(0, 1, 0), false), ("second", at(0, 1, 0), false)],
            None,
            vec!["second"],
        ),
        base(
            "thin: one per calendar hour, each hour's oldest",
            RetentionPolicy::thin(1),
            vec![
                ("h09_30", at(0, 9, 30), false),
                ("h10_01", at(0, 10, 1), false),
                ("h10_59", at(0, 10, 59), false),
                ("h11_10", at(0, 11, 10), false),
                ("h11_50", at(0, 11, 50), false),
                ("h12_20", at(0, 12, 20), false),
            ],
            Some("h12_20"),
            vec!["h09_30", "h10_01", "h11_10", "h11_50", "h12_20"],
        ),
        base(
            "thin: the newest retain do not take part in bucketing",
            RetentionPolicy::thin(2),
            vec![
                ("h12_05", at(0, 12, 5), false),
                ("h12_10", at(0, 12, 10), false),
                ("h12_15", at(0, 12, 15), false),
                ("h12_20", at(0, 12, 20), false),
            ],
            None,
            vec!["h12_05", "h12_15", "h12_20"],
        ),
        base(
            "thin: past a day, one per UTC day, each day's oldest; hour tier up to 24 h",
            RetentionPolicy::thin(1),
            vec![
                ("d40", at(40, 10, 0), false),
                ("d30_old", at(30, 12, 0), false),
                ("d29_edge", at(29, 12, 31), false),
                ("d2_08", at(2, 8, 0), false),
                ("d2_20", at(2, 20, 0), false),
                ("d1_09", at(1, 9, 0), false),
                ("d1_10", at(1, 10, 0), false),
                ("d1_11", at(1, 11, 0), false),
                ("d1_13", at(1, 13, 0), false),
                ("d1_13b", at(1, 13, 40), false),
                ("d1_14", at(1, 14, 0), false),
                ("now", at(0, 12, 29), false),
            ],
            Some("now"),
            vec!["d29_edge", "d2_08", "d1_09", "d1_13", "d1_14", "now"],
        ),
        base(
            "thin boundaries: exactly 24 h is day tier, exactly 30 days is gone",
            RetentionPolicy::thin(0),
            vec![
                ("day30", NOW - 30 * DAY_MS, false),
                ("day_tier_a", NOW - DAY_MS - HOUR_MS, false),
                ("day_tier_b", NOW - DAY_MS, false),
                ("hour_tier", NOW - DAY_MS + 1, false),
            ],
            None,
            // day_tier_a and day_tier_b share a UTC day (yesterday 11:30 and 12:30): the older stays.
            vec!["day_tier_a", "hour_tier"],
        ),
        base(
            "thin: a mark from the future (clock skew) is hour tier, not a panic",
            RetentionPolicy::thin(0),
            vec![("future", NOW + 5 * HOUR_MS, false), ("past", NOW - 5 * MINUTE_MS, false)],
            None,
            vec!["future", "past"],
        ),
        base(
            "without thin nothing past retain is bucketed",
            RetentionPolicy::retain(1),
            vec![("d1", at(1, 9, 0), false), ("d2", at(2, 9, 0), false), ("h", at(0, 9, 0), false)],
            None,
            vec!["h"],
        ),
        base(
            "the example in docs/ledger.md",
            RetentionPolicy::thin(2),
            vec![
                ("nov01_0900", at(31, 9, 0), false),
                ("nov20_0800", at(12, 8, 0), false),
                ("nov20_1900", at(12, 19, 0), false),
                ("nov25_1000_pin", at(7, 10, 0), true),
                ("dec01_0900", at(1, 9, 0), false),
                ("dec01_1000", at(1, 10, 0), false),
                ("dec01_1300", at(1, 13, 0), false),
                ("dec01_1340", at(1, 13, 40), false),
                ("dec02_1105", at(0, 11, 5), false),
                ("dec02_1145", at(0, 11, 45), false),
                ("dec02_1210", at(0, 12, 10), false),
                ("dec02_1220", at(0, 12, 20), false),
            ],
            Some("dec02_1220"),
            vec![
                "nov20_0800",
                "nov25_1000_pin",
                "dec01_0900",
                "dec01_1300",
                "dec02_1105",
                "dec02_1145",
                "dec02_1210",
                "dec02_1220",
            ],
        ),
        Case {
            name: "marks needed elsewhere are kept despite retain 0",
            policy: RetentionPolicy::retain(0),
            live: true,
            marks: abcde.clone(),
            head: Some("e"),
            elsewhere: vec![
                ("a", KeepReason::ForkPoint),
                ("b", KeepReason::Lease),
                ("c", KeepReason::Base),
                ("d", KeepReason::LiveSandbox),
            ],
            keep: vec!["a", "b", "c", "d", "e"],
        },
        Case {
            name: "a deleted branch keeps only what is needed elsewhere, even pins and its head",
            policy: RetentionPolicy::KEEP_ALL,
            live: false,
            marks: vec![("a", at(0, 1, 0), true), ("b", at(0, 2, 0), false), ("c", at(0, 3, 0), false)],
            head: Some("c"),
            elsewhere: vec![("b", KeepReason::ForkPoint)],
            keep: vec!["b"],
        },
    ]
}

#[test]
fn retention_table() {
    let mut failures = Vec::new();
    for c in cases() {
        let got: BTreeSet<String> = plan(&c, NOW).into_iter().filter(|(_, r)| !r.is_empty()).map(|(l, _)| l).collect();
        let want: BTreeSet<String> = c.keep.iter().map(|s| s.to_string()).collect();
        if got != want {
            failures.push(format!("{}: kept {got:?}, expected {want:?}", c.name));
        }
    }
    assert!(failures.is_empty(), "retention cases failed:\n{}", failures.join("\n"));
}

#[test]
fn reasons_say_why() {
    let c = Case {
        name: "reasons",
        policy: RetentionPolicy::thin(1),
        live: true,
        marks: vec![
            ("day", at(3, 5, 0), false),
            ("hour_a", at(0, 8, 10), false),
            ("hour_b", at(0, 9, 0), true),
            ("second", at(0, 12, 0), false),
            ("newest", at(0, 12, 20), false),
        ],
        head: Some("newest"),
        elsewhere: vec![("day", KeepReason::Lease)],
        keep: vec![],
    };
    let got: HashMap<String, Vec<KeepReason>> = plan(&c, NOW).into_iter().collect();
    assert_eq!(got["newest"], vec![KeepReason::Head], "the head takes no retain slot");
    assert_eq!(got["second"], vec![KeepReason::Newest]);
    assert_eq!(got["hour_b"], vec![KeepReason::Pinned, KeepReason::HourBucket]);
    assert_eq!(got["hour_a"], vec![KeepReason::HourBucket]);
    assert_eq!(got["day"], vec![KeepReason::DayBucket, KeepReason::Lease]);
}

/// A mark every 10 minutes for 40 days, collected every hour with `retain 3, thin`. A mark that a
/// collection kept may only be deleted by a later one when it crossed a tier boundary since (into
/// the day tier without being its day's oldest, or past 30 days): a newer mark never displaces it.
#[test]
fn thinning_is_stable_over_a_simulated_month() {
    let policy = RetentionPolicy::thin(3);
    let start = D0 - 40 * DAY_MS;
    let mut marks: Vec<MarkFacts> = Vec::new();
    let mut last: HashMap<MarkId, Vec<KeepReason>> = HashMap::new();
    let mut checked = 0;
    let mut seq = 0;
    let mut now = start;
    let end = D0;
    while now < end {
        for _ in 0..6 {
            now += 10 * MINUTE_MS;
            marks.push(MarkFacts { id: MarkId::new(format!("m{seq}")), created_ms: now, pinned: seq % 97 == 0, seq });
            seq += 1;
        }
        let head = marks.last().map(|m| m.id.clone());
        let input = BranchInput { policy, live: true, head: head.as_ref(), marks: &marks };
        let verdicts = plan_branch(input, &HashMap::new(), now);
        for v in verdicts.iter().filter(|v| !v.keep()) {
            let Some(before) = last.get(&v.id) else { continue };
            let created = marks.iter().find(|m| m.id == v.id).map(|m| m.created_ms).unwrap();
            let age = now - created;
            if before.contains(&KeepReason::HourBucket) {
                checked += 1;
                assert!(age >= DAY_MS, "{} was its hour's keeper and went at age {age} ms, before a day", v.id);
            }
            if before.contains(&KeepReason::DayBucket) {
                checked += 1;
                assert!(age >= 30 * DAY_MS, "{} was its day's keeper and went at age {age} ms", v.id);
            }
        }
        last = verdicts.iter().filter(|v| v.keep()).map(|v| (v.id.clone(), v.reasons.clone())).collect();
        marks.retain(|m| last.contains_key(&m.id));
    }
    assert!(checked > 100, "the simulation let go of only {checked} keepers; it tests nothing");
    // In steady state: the head, newest 3, at most 25 hour keepers, at most 31 day keepers, and the pins.
    let pins = marks.iter().filter(|m| m.pinned).count();
    assert!(pins <= PROTECTED_PINS);
    let unpinned = marks.len() - pins;
    assert!(unpinned <= 1 + 3 + 25 + 31, "kept {unpinned} unpinned marks after a month");
    let day_tier = marks.iter().filter(|m| !m.pinned && (DAY_MS..30 * DAY_MS).contains(&(now - m.created_ms))).count();
    assert!((28..=31).contains(&day_tier), "one per day for a month, got {day_tier}");
    let hour_tier = marks.iter().filter(|m| !m.pinned && now - m.created_ms < DAY_MS).count();
    assert!((24..=1 + 3 + 25).contains(&hour_tier), "one per hour for a day plus the newest, got {hour_tier}");
    assert!(marks.iter().all(|m| m.pinned || now - m.created_ms < 30 * DAY_MS), "nothing unpinned older than 30 days");
}
