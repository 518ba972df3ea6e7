//! "Did you mean ...?": the nearest valid name to a misspelt one.
//!
//! Edit distance (Levenshtein, case-insensitive) with a threshold that grows
//! with the name's length, so `a100-40g` finds `a100-40gb` but `x` finds
//! nothing; a candidate that starts with what was written (`h100` for
//! `h100-80gb`) is also offered. Ties go to the earlier candidate, so the
//! answer is deterministic and follows catalog / reference order.

/// Levenshtein distance over chars.
pub(crate) fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, ca) in a.chars().enumerate() {
        cur[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

/// The candidate nearest to `name`, if one is near enough to be a likely typo.
pub(crate) fn nearest<'c, I>(name: &str, candidates: I) -> Option<String>
where
    I: IntoIterator<Item = &'c str>,
{
    let lower = name.to_ascii_lowercase();
    let limit = (lower.chars().count() / 3).max(2);
    let mut best: Option<(usize, &str)> = None;
    for c in candidates {
        if c == name {
            continue;
        }
        let d = distance(&lower, c);
        let prefix = lower.len() >= 2 && c.starts_with(lower.as_str());
        if (d <= limit || prefix) && best.is_none_or(|(bd, _)| d < bd) {
            best = Some((d, c));
        }
    }
    best.map(|(_, c)| c.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distances() {
        assert_eq!(distance("kitten", "sitting"), 3);
        assert_eq!(distance("", "abc"), 3);
        assert_eq!(distance("same", "same"), 0);
    }

    #[test]
    fn suggestions() {
        let gpus = ["h100-80gb", "a100-80gb", "a100-40gb"];
        assert_eq!(nearest("a100-40g", gpus).as_deref(), Some("a100-40gb"));
        assert_eq!(nearest("h100", gpus).as_deref(), Some("h100-80gb"));
        assert_eq!(nearest("A100-40GB", gpus).as_deref(), Some("a100-40gb"));
        assert_eq!(nearest("tpu-v5", gpus), None);
        assert_eq!(
            nearest("sq_len", ["seq_len", "global_batch"]).as_deref(),
            Some("seq_len")
        );
    }
}
