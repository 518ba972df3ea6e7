//! Packing whole examples into sequences (`train { packing = true }`), as TRL's
//! `pack_dataset(..., strategy = "bfd")` followed by its padding-free collator:
//!
//! - examples are cut to `seq_len` tokens and binned by best-fit decreasing, longest first,
//!   each into the open bin with the least room that holds it (the oldest such bin on a
//!   tie), a new bin where none does;
//! - a bin is one row; its examples follow each other, the rest of the row is padding;
//! - positions restart at 0 with each example (transformers' `position_ids`), and a row's
//!   documents are where its positions do not go up by one (transformers'
//!   `find_packed_sequence_indices`), so attention stays within each example;
//! - an example's last token predicts nothing (TRL sets the label after it to -100), so
//!   the loss is the unpacked examples' loss, and each step's mean is over its scored
//!   tokens as before.

use super::{Completion, SftRows};
use std::collections::{BTreeMap, VecDeque};

/// Best-fit decreasing bins of items of `lengths` (each at most `capacity`), as TRL's
/// `_pack_bfd`: items by decreasing length (in their order on a tie), each into the bin
/// with the least room left that holds it, the oldest of those first; a new bin where no
/// bin holds it. Bins come in the order they were opened, items in the order placed.
pub fn best_fit_decreasing(lengths: &[usize], capacity: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
    let mut bins: Vec<(Vec<usize>, usize)> = Vec::new();
    // Room left -> the bins with that room, oldest first.
    let mut by_room: BTreeMap<usize, VecDeque<usize>> = BTreeMap::new();
    for i in order {
        let len = lengths[i];
        debug_assert!(len <= capacity, "items are cut to the capacity first");
        let fit = by_room.range_mut(len..).next().map(|(&room, bins)| {
            let b = bins.pop_front().expect("no empty queue is kept");
            (room, b, bins.is_empty())
        });
        let b = match fit {
            Some((room, b, emptied)) => {
                if emptied {
                    by_room.remove(&room);
                }
                b
            }
            None => {
                bins.push((Vec::new(), 0));
                bins.len() - 1
            }
        };
        bins[b].0.push(i);
        bins[b].1 += len;
        let room = capacity - bins[b].1;
        if room > 0 {
            by_room.entry(room).or_default().push_back(b);
        }
    }
    bins.into_iter().map(|(items, _)| items).collect()
}

/// The packed rows of `examples` for sequences of `seq` tokens.
pub fn bins(examples: &[Completion], seq: usize) -> Vec<Vec<usize>> {
    let lengths: Vec<usize> = examples.iter().map(|e| e.ids.len().min(seq)).collect();
    best_fit_decreasing(&lengths, seq)
}

/// One packed row of `seq` positions, appended to `out` (whose rows are packed): the
/// examples of `bin` one after the other (each cut to `seq` tokens, its last position
/// scoring nothing), then `pad` to the end; positions restart at 0 with each example and
/// with the padding.
pub fn row(examples: &[Completion], bin: &[usize], seq: usize, pad: u32, out: &mut SftRows) {
    let SftRows {
        inputs,
        targets,
        weights,
        positions,
    } = out;
    let positions = positions.as_mut().expect("packed rows carry positions");
    let start = inputs.len();
    for &e in bin {
        let len = examples[e].ids.len().min(seq);
        examples[e].tokens(len, seq, pad, inputs, targets, weights);
        positions.extend(0..len as i64);
    }
    let rest = seq - (inputs.len() - start);
    inputs.extend(std::iter::repeat_n(pad as i64, rest));
    targets.extend(std::iter::repeat_n(pad as i64, rest));
    weights.extend(std::iter::repeat_n(0.0, rest));
    positions.extend(0..rest as i64);
}

/// Each token's document in its row, numbered from 0 per row, from the positions of
/// `[rows, seq]` tokens: a document starts where a position is not its predecessor's plus
/// one, as transformers' `find_packed_sequence_indices` reads `position_ids`.
pub fn documents(positions: &[i64], seq: usize) -> Vec<i64> {
    let mut out = Vec::with_capacity(positions.len());
    for row in positions.chunks(seq) {
        let mut doc = 0;
        for (p, &pos) in row.iter().enumerate() {
            if p > 0 && pos != row[p - 1] + 1 {
                doc += 1;
            }
            out.push(doc);
        }
    }
    out
}

/// Each token's document in its row as `[start, end)`, `[rows, seq, 2]` flattened, from
/// the positions of `[rows, seq]` tokens ([`documents`]): what the fused attention's
/// kernels mask by.
pub fn spans(positions: &[i64], seq: usize) -> Vec<i64> {
    let docs = documents(positions, seq);
    let mut out = Vec::with_capacity(2 * positions.len());
    for row in docs.chunks(seq) {
        let mut start = 0;
        while start < row.len() {
            let end = start
                + row[start..]
                    .iter()
                    .take_while(|&&d| d == row[start])
                    .count();
            for _ in start..end {
                out.extend([start as i64, end as i64]);
            }
            start = end;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TRL's `_pack_bfd` on lengths [5, 3, 8, 2, 4, 4] into 8: sorted 8, 5, 4, 4, 3, 2
    /// (in file order on a tie); 8 fills bin 0, 5 opens bin 1 (room 3), 4 opens bin 2
    /// (room 4), the second 4 fills bin 2, 3 fills bin 1, 2 opens bin 3.
    #[test]
    fn bins_are_best_fit_decreasing_as_trl_packs() {
        let bins = best_fit_decreasing(&[5, 3, 8, 2, 4, 4], 8);
        assert_eq!(bins, vec![vec![2], vec![0, 1], vec![4, 5], vec![3]]);
        // The least room that fits, not the first: 8 and 6 open bins of room 2 and 4, 3
        // joins 6 (room 1 left), and 1 then goes there, not to the older bin of room 2.
        let bins = best_fit_decreasing(&[1, 3, 6, 8], 10);
        assert_eq!(bins, vec![vec![3], vec![2, 1, 0]]);
        // Oldest first among equal rooms.
        let bins = best_fit_decreasing(&[7, 7, 1], 8);
        assert_eq!(bins, vec![vec![0, 2], vec![1]]);
    }

    #[test]
    fn every_item_lands_in_one_bin_within_capacity() {
        let lengths: Vec<usize> = (0..200).map(|i| 1 + (i * 37 + 11) % 64).collect();
        let bins = best_fit_decreasing(&lengths, 64);
        let mut seen: Vec<usize> = bins.iter().flatten().copied().collect();
        seen.sort();
        assert_eq!(seen, (0..200).collect::<Vec<_>>());
        for b in &bins {
            assert!(b.iter().map(|&i| lengths[i]).sum::<usize>() <= 64);
        }
        // Best-fit decreasing is within 11/9 of the fewest bins plus one.
        let total: usize = lengths.iter().sum();
        assert!(
            bins.len() <= total.div_ceil(64) * 11 / 9 + 1,
            "{}",
            bins.len()
        );
    }

    #[test]
    fn documents_start_where_positions_restart() {
        let positions = [
            0, 1, 2, 0, 1, 0, 0, 1, /* row 2 */ 0, 1, 2, 3, 4, 5, 6, 7,
        ];
        assert_eq!(
            documents(&positions, 8),
            [0, 0, 0, 1, 1, 2, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0]
        );
    }

    #[test]
    fn spans_are_each_token_s_document() {
        let positions = [0, 1, 2, 0, 1, 0, /* row 2 */ 0, 1, 2, 3, 4, 5];
        assert_eq!(
            spans(&positions, 6),
            [0, 3, 0, 3, 0, 3, 3, 5, 3, 5, 5, 6, 0, 6, 0, 6, 0, 6, 0, 6, 0, 6, 0, 6]
        );
    }

    /// A row holds its examples' tokens with their own targets and weights, the last
    /// token of each scoring nothing, and positions from 0 for each.
    #[test]
    fn a_row_is_its_examples_one_after_the_other() {
        let ex = |ids: &[u32], prompt| Completion {
            ids: ids.to_vec(),
            prompt,
            assistant: None,
        };
        let examples = [ex(&[10, 11, 12], 1), ex(&[20, 21, 22, 23], 2)];
        let mut out = SftRows::new(true);
        row(&examples, &[1, 0], 9, 0, &mut out);
        assert_eq!(out.inputs, [20, 21, 22, 23, 10, 11, 12, 0, 0]);
        assert_eq!(&out.targets[..7], [21, 22, 23, 0, 11, 12, 0]);
        assert_eq!(out.weights, [0., 1., 1., 0., 1., 1., 0., 0., 0.]);
        assert_eq!(out.positions.unwrap(), [0, 1, 2, 3, 0, 1, 2, 0, 1]);
        let scored: usize = examples.iter().map(|e| e.scored(9)).sum();
        assert_eq!(out.weights.iter().sum::<f32>() as usize, scored);
    }
}
