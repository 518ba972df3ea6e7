//! Which kernel a compile worker process takes next, and whether it writes
//! its header set's precompiled header first.
//!
//! NVRTC reads a precompiled header only in the process that wrote it, so
//! each worker writes its own, at about the cost of one compile (1.3 s for
//! CUDA's barrier headers on the 2-core machine that measured it, where a
//! kernel reading it back saves 1.2 s). Handing kernels out in plain
//! longest-first order spreads every header set over every worker: each
//! worker writes a header for every large set, and a set with fewer than two
//! kernels a worker is not worth one anywhere (on 16 cores, any set under
//! 32 kernels parses its headers in full for every kernel). Instead a worker
//! prefers kernels of the sets it holds a header for, among the next few in
//! line (as many as there are workers, so a long kernel waits at most a
//! round), and writes a header for a new set only where the set's kernels
//! still to hand out come to two or more for each worker holding it, itself
//! included. A set's kernels then gather on as few workers as keep them
//! busy, and small sets get a header on one or two workers.

use std::sync::Mutex;

/// The compile phase's hand-out of kernels to worker slots.
pub(super) struct HeaderAffinity {
    state: Mutex<State>,
}

struct State {
    /// Kernels not yet handed out, as indices into the phase's list, in the
    /// order to take them (longest source first).
    queue: Vec<usize>,
    /// Each kernel's header set, as an index into `left` and `holders`.
    set: Vec<usize>,
    /// Per set: its kernels not yet handed out.
    left: Vec<usize>,
    /// Per set: the workers holding its precompiled header.
    holders: Vec<usize>,
    /// Per slot: the sets its worker holds a precompiled header for.
    held: Vec<Vec<usize>>,
    /// Per set: whether some worker wrote its precompiled header, the worker
    /// alive or not (the kernels it compiled read it).
    written: Vec<bool>,
    /// Whether NVRTC writes precompiled headers at all (12.8 and later).
    precompile: bool,
    /// Precompiled headers asked for, over all workers.
    writes: usize,
}

impl HeaderAffinity {
    /// `sets[i]` is the header set of kernel `i` (any labels: equal labels,
    /// equal sets), kernels in the order to take them; `slots` workers.
    pub(super) fn new<S: PartialEq>(sets: &[S], slots: usize, precompile: bool) -> Self {
        let mut labels: Vec<&S> = Vec::new();
        let set: Vec<usize> = sets
            .iter()
            .map(|s| match labels.iter().position(|l| *l == s) {
                Some(i) => i,
                None => {
                    labels.push(s);
                    labels.len() - 1
                }
            })
            .collect();
        let mut left = vec![0; labels.len()];
        for &s in &set {
            left[s] += 1;
        }
        HeaderAffinity {
            state: Mutex::new(State {
                queue: (0..sets.len()).collect(),
                set,
                holders: vec![0; left.len()],
                written: vec![false; left.len()],
                left,
                held: vec![Vec::new(); slots.max(1)],
                precompile,
                writes: 0,
            }),
        }
    }

    /// The kernel `slot`'s worker compiles next, and whether it compiles it
    /// with its set's precompiled header (writing it first if it has none);
    /// `None` when every kernel is handed out.
    pub(super) fn next(&self, slot: usize) -> Option<(usize, bool)> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let s = &mut *s;
        if s.queue.is_empty() {
            return None;
        }
        let window = s.held.len().min(s.queue.len());
        let held = &s.held[slot];
        // A kernel of a held set in the window (the head itself, if its set is held).
        let found = s.queue[..window]
            .iter()
            .position(|&k| held.contains(&s.set[k]));
        let holds = found.is_some();
        let kernel = s.queue.remove(found.unwrap_or(0));
        let set = s.set[kernel];
        // Two or more of the set's kernels (this one included) for each of
        // its holders, this worker among them: worth a header here.
        let write = !holds && s.precompile && s.left[set] >= 2 * (s.holders[set] + 1);
        if write {
            s.held[slot].push(set);
            s.holders[set] += 1;
            s.written[set] = true;
            s.writes += 1;
        }
        s.left[set] -= 1;
        Some((kernel, holds || write))
    }

    /// `slot`'s worker ended (a crash, or it could not start): its headers
    /// went with it, and the next kernel there starts a new worker.
    pub(super) fn lost(&self, slot: usize) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for set in std::mem::take(&mut s.held[slot]) {
            s.holders[set] -= 1;
        }
    }

    /// Distinct header sets some worker precompiled (one that died since
    /// included), and precompiled headers asked for in all (a worker writes
    /// one per set it holds).
    pub(super) fn headers(&self) -> (usize, usize) {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        (s.written.iter().filter(|&&w| w).count(), s.writes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel handed out once, each with its slot and header use.
    fn hand_out(a: &HeaderAffinity, order: &[usize]) -> Vec<(usize, usize, bool)> {
        let mut out = Vec::new();
        loop {
            let mut any = false;
            for &slot in order {
                if let Some((k, pch)) = a.next(slot) {
                    out.push((slot, k, pch));
                    any = true;
                }
            }
            if !any {
                return out;
            }
        }
    }

    #[test]
    fn each_kernel_is_handed_out_once_and_a_set_stays_with_its_workers() {
        // Two sets of eight, interleaved (as longest-first order mixes them), two workers.
        let sets: Vec<char> = (0..16)
            .map(|i| if i % 2 == 0 { 'a' } else { 'b' })
            .collect();
        let a = HeaderAffinity::new(&sets, 2, true);
        let out = hand_out(&a, &[0, 1]);
        let mut kernels: Vec<usize> = out.iter().map(|&(_, k, _)| k).collect();
        kernels.sort_unstable();
        assert_eq!(kernels, (0..16).collect::<Vec<_>>());
        // Worker 0 took 'a' first and keeps to it, worker 1 to 'b': one header each,
        // where plain order would have each write both.
        for &(slot, k, pch) in &out {
            assert_eq!(sets[k], if slot == 0 { 'a' } else { 'b' }, "{out:?}");
            assert!(pch);
        }
        assert_eq!(a.headers(), (2, 2));
        assert_eq!(a.next(0), None);
    }

    #[test]
    fn a_long_kernel_of_another_set_waits_at_most_a_round() {
        // Worker 0 holds 'a'; 'b' heads the line and more 'a' kernels follow within the
        // window of two: it takes an 'a'. Past the window it takes the head.
        let sets = ['a', 'a', 'a', 'b', 'a', 'b', 'b', 'a', 'a', 'a'];
        let a = HeaderAffinity::new(&sets, 2, true);
        assert_eq!(a.next(0), Some((0, true)));
        assert_eq!(a.next(0), Some((1, true)));
        assert_eq!(a.next(0), Some((2, true)));
        // The line is now b a b b a a a: 'a' (index 4) is within the window.
        assert_eq!(a.next(0), Some((4, true)));
        // b b b a a a: the window [b, b] holds no 'a', so the head; three 'b' left,
        // two or more for one holder: worker 0 writes that set's header too.
        assert_eq!(a.next(0), Some((3, true)));
        assert_eq!(a.headers(), (2, 2));
    }

    #[test]
    fn a_header_is_written_only_where_its_set_has_two_kernels_a_holder() {
        // Eight kernels of one set on four workers: 8 >= 2, 7 >= 4 and 6 >= 6 kernels
        // left for the first three, each then a holder; 5 < 8 for the fourth, which
        // compiles its two without one.
        let a = HeaderAffinity::new(&['x'; 8], 4, true);
        let out = hand_out(&a, &[0, 1, 2, 3]);
        let with: Vec<bool> = out.iter().map(|&(_, _, pch)| pch).collect();
        assert_eq!(with, [true, true, true, false, true, true, true, false]);
        assert_eq!(a.headers(), (1, 3));
        // A kernel alone in its set is never worth a header.
        let a = HeaderAffinity::new(&['x', 'y'], 1, true);
        assert_eq!(hand_out(&a, &[0]), [(0, 0, false), (0, 1, false)]);
        assert_eq!(a.headers(), (0, 0));
        // Without NVRTC's precompiled headers, none.
        let a = HeaderAffinity::new(&['x'; 6], 2, false);
        assert!(hand_out(&a, &[0, 1]).iter().all(|&(_, _, pch)| !pch));
        assert_eq!(a.headers(), (0, 0));
    }

    #[test]
    fn a_lost_worker_holds_nothing_and_its_replacement_writes_again() {
        let a = HeaderAffinity::new(&['x'; 8], 2, true);
        assert_eq!(a.next(0), Some((0, true)));
        a.lost(0);
        // The set was precompiled, for the kernel the lost worker compiled.
        assert_eq!(a.headers(), (1, 1));
        // Seven left, no holder: slot 0's new worker writes its own.
        assert_eq!(a.next(0), Some((1, true)));
        assert_eq!(a.headers(), (1, 2));
    }
}
