//! The grouping that keeps long key lists readable: keys that differ only in their numbers shown
//! as one pattern (`encoder.layer.{0..11}.attention.self.query.weight`), and the prefix keys
//! share. Load reports ([`LoadReport`](crate::LoadReport)) print with it.

use std::collections::HashMap;

/// Marks a number's place in a template.
pub const SLOT: char = '\u{1}';

/// `key` with every numeric segment replaced by [`SLOT`], and those numbers:
/// `encoder.layer.3.output` is (`encoder.layer.\u{1}.output`, `[3]`).
pub fn numbered(key: &str) -> (String, Vec<u64>) {
    let mut template = String::with_capacity(key.len());
    let mut nums = Vec::new();
    for (i, segment) in key.split('.').enumerate() {
        if i > 0 {
            template.push('.');
        }
        let canonical = !segment.is_empty()
            && segment.bytes().all(|b| b.is_ascii_digit())
            && (segment == "0" || !segment.starts_with('0'));
        match segment.parse::<u64>() {
            Ok(n) if canonical => {
                template.push(SLOT);
                nums.push(n);
            }
            _ => template.push_str(segment),
        }
    }
    (template, nums)
}

/// Several keys (or lines) shown as one pattern.
#[derive(Debug, PartialEq)]
pub struct Group {
    /// The keys in brace notation (`layer.{0..11}.weight`; `a..b` is inclusive, as in a shell).
    pub pattern: String,
    /// How many keys it stands for.
    pub count: usize,
    /// The index of its first item in the input.
    pub first: usize,
}

/// Groups keys that differ only in their numbers: `encoder.layer.{0..11}.attention.self.query.weight`.
/// Groups come in the order of their first key.
pub fn group_keys<'a>(keys: impl IntoIterator<Item = &'a str>) -> Vec<Group> {
    group(keys.into_iter().map(|k| {
        let (template, nums) = numbered(k);
        (template, nums)
    }))
}

/// Groups `(missing, unexpected)` pairs that differ only in numbers both keys share:
/// `("encoder.layer.{0..11}.ln.weight", "encoder.layer.{0..11}.LayerNorm.weight")`, as
/// `missing\u{0}unexpected` patterns.
pub fn group_pairs(pairs: &[(String, String)]) -> Vec<Group> {
    group(pairs.iter().map(|(m, u)| {
        let (tm, nm) = numbered(m);
        let (tu, nu) = numbered(u);
        if nm == nu {
            (format!("{tm}\u{0}{tu}"), nm)
        } else {
            // Different numbers on the two sides: a pair of its own.
            (format!("{m}\u{0}{u}"), Vec::new())
        }
    }))
}

/// Groups items by template; within a template, numbers that form a full grid
/// (`{0..11}` × `{0..2}`) become one group, others are split by their first varying number.
fn group(items: impl Iterator<Item = (String, Vec<u64>)>) -> Vec<Group> {
    let mut templates: Vec<(String, Vec<Row>)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    for (i, (template, nums)) in items.enumerate() {
        match index.get(&template) {
            Some(&t) => templates[t].1.push((i, nums)),
            None => {
                index.insert(template.clone(), templates.len());
                templates.push((template, vec![(i, nums)]));
            }
        }
    }
    let mut out = Vec::new();
    for (template, mut rows) in templates {
        rows.sort_by(|a, b| a.1.cmp(&b.1));
        rows.dedup_by(|a, b| a.1 == b.1);
        grid(&template, &rows, &mut out);
    }
    out.sort_by_key(|g| g.first);
    out
}

/// One item of a template: its index in the input and its numbers.
type Row = (usize, Vec<u64>);

fn grid(template: &str, rows: &[Row], out: &mut Vec<Group>) {
    let width = rows[0].1.len();
    let sets: Vec<Vec<u64>> = (0..width)
        .map(|p| {
            let mut s: Vec<u64> = rows.iter().map(|r| r.1[p]).collect();
            s.sort_unstable();
            s.dedup();
            s
        })
        .collect();
    let cells = sets
        .iter()
        .try_fold(1usize, |acc, s| acc.checked_mul(s.len()));
    if cells == Some(rows.len()) {
        out.push(Group {
            pattern: render(template, &sets),
            count: rows.len(),
            first: rows.iter().map(|r| r.0).min().unwrap_or(0),
        });
        return;
    }
    // Not a full grid: split on the first number that varies, and group each part.
    let p = sets
        .iter()
        .position(|s| s.len() > 1)
        .expect("a single row is a grid");
    for v in &sets[p] {
        let part: Vec<_> = rows.iter().filter(|r| r.1[p] == *v).cloned().collect();
        grid(template, &part, out);
    }
}

/// Fills a template's slots with the sets; a template of a pair has its numbers twice.
fn render(template: &str, sets: &[Vec<u64>]) -> String {
    let mut out = String::with_capacity(template.len() + 8);
    let mut slot = 0;
    for c in template.chars() {
        if c == SLOT {
            out.push_str(&render_set(&sets[slot % sets.len()]));
            slot += 1;
        } else {
            out.push(c);
        }
    }
    out
}

/// `3`, `{0,1}`, `{0..11}`, `{0..3,7}`: runs of three or more as inclusive ranges (bash's brace
/// expansion reads them back).
fn render_set(set: &[u64]) -> String {
    if let [one] = set {
        return one.to_string();
    }
    let mut parts = Vec::new();
    let mut i = 0;
    while i < set.len() {
        let mut j = i;
        while j + 1 < set.len() && set[j + 1] == set[j] + 1 {
            j += 1;
        }
        if j - i >= 2 {
            parts.push(format!("{}..{}", set[i], set[j]));
        } else {
            parts.extend(set[i..=j].iter().map(u64::to_string));
        }
        i = j + 1;
    }
    format!("{{{}}}", parts.join(","))
}

/// The segments all `keys` share at their start, as `a.b.*`, or `None` when they share none.
pub fn common_prefix<'a>(keys: impl IntoIterator<Item = &'a str>) -> Option<String> {
    let mut common: Option<Vec<&str>> = None;
    for key in keys {
        let segments = pattern_segments(key);
        // The last segment is the key's own name, never a prefix.
        let segments = &segments[..segments.len().saturating_sub(1)];
        common = Some(match common {
            None => segments.to_vec(),
            Some(c) => c
                .iter()
                .zip(segments)
                .take_while(|(a, b)| a == b)
                .map(|(a, _)| *a)
                .collect(),
        });
    }
    common
        .filter(|c| !c.is_empty())
        .map(|c| format!("{}.*", c.join(".")))
}

/// A key or pattern's segments: dots inside braces (`{0..11}`) do not split.
fn pattern_segments(pattern: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0usize, 0);
    for (i, c) in pattern.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            '.' if depth == 0 => {
                out.push(&pattern[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&pattern[start..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn patterns(keys: &[&str]) -> Vec<(String, usize)> {
        group_keys(keys.iter().copied())
            .into_iter()
            .map(|g| (g.pattern, g.count))
            .collect()
    }

    #[test]
    fn numbers_group_into_ranges() {
        let keys: Vec<String> = (0..12)
            .flat_map(|l| {
                [
                    format!("encoder.layer.{l}.attention.self.query.weight"),
                    format!("encoder.layer.{l}.attention.self.query.bias"),
                ]
            })
            .chain(["pooler.dense.weight".to_owned()])
            .collect();
        assert_eq!(
            patterns(&keys.iter().map(String::as_str).collect::<Vec<_>>()),
            [
                (
                    "encoder.layer.{0..11}.attention.self.query.weight".to_owned(),
                    12
                ),
                (
                    "encoder.layer.{0..11}.attention.self.query.bias".to_owned(),
                    12
                ),
                ("pooler.dense.weight".to_owned(), 1),
            ]
        );
    }

    #[test]
    fn sets_and_grids() {
        assert_eq!(
            patterns(&["a.0.w", "a.1.w", "a.3.w", "a.4.w", "a.5.w", "a.9.w"]),
            [("a.{0,1,3..5,9}.w".to_owned(), 6)]
        );
        assert_eq!(
            patterns(&["a.0.b.0", "a.0.b.1", "a.1.b.0", "a.1.b.1"]),
            [("a.{0,1}.b.{0,1}".to_owned(), 4)]
        );
        // Not a grid: split on the first number.
        assert_eq!(
            patterns(&["a.0.b.0", "a.0.b.1", "a.1.b.0"]),
            [("a.0.b.{0,1}".to_owned(), 2), ("a.1.b.0".to_owned(), 1)]
        );
        // Leading zeros are names, not numbers.
        assert_eq!(
            patterns(&["a.01", "a.1"]),
            [("a.01".to_owned(), 1), ("a.1".to_owned(), 1)]
        );
    }

    #[test]
    fn pairs_group_when_both_sides_share_the_numbers() {
        let pairs: Vec<(String, String)> = (0..3)
            .map(|l| {
                (
                    format!("h.{l}.ln.weight"),
                    format!("h.{l}.LayerNorm.weight"),
                )
            })
            .collect();
        let groups = group_pairs(&pairs);
        assert_eq!(groups.len(), 1);
        assert_eq!(
            groups[0].pattern,
            "h.{0..2}.ln.weight\u{0}h.{0..2}.LayerNorm.weight"
        );
    }

    #[test]
    fn common_prefixes() {
        assert_eq!(
            common_prefix(["encoder.layer.6.a.weight", "encoder.layer.11.b.bias"]),
            Some("encoder.layer.*".to_owned())
        );
        assert_eq!(common_prefix(["a.weight", "b.weight"]), None);
        assert_eq!(
            common_prefix(["h.{6..11}.ln.weight", "h.{6..11}.fc.bias"]),
            Some("h.{6..11}.*".to_owned())
        );
    }
}
