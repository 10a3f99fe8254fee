//! The accept/resample rule of speculative decoding with copy proposals, as the reference the
//! device sampler and the simulated executor follow.
//!
//! A copy proposal is a single token, a point mass as a draft distribution. Against the target
//! distribution `p` of that position it is accepted with probability `p(x)`; when rejected, the
//! token is drawn from `p` with `x` removed (the residual `max(0, p - q)`, normalized). The
//! emitted token is then distributed exactly as `p`: `P(x) = p(x)` and, for `y != x`,
//! `P(y) = (1 - p(x)) · p(y) / (1 - p(x)) = p(y)`. Verification walks the proposals in order
//! and stops at the first rejection; when all are accepted, one more token is drawn from the
//! next position's `p`. With a point-mass target (top-k 1) it reproduces greedy decoding
//! token for token.

/// Draws from `p` (non-negative weights, not necessarily normalized) by inverse CDF at `u` in
/// `[0, 1)`, skipping `exclude`. `None` when no weight remains.
pub fn draw(p: &[f64], u: f64, exclude: Option<u32>) -> Option<u32> {
    let weight = |i: usize| if exclude == Some(i as u32) { 0.0 } else { p[i].max(0.0) };
    let total: f64 = (0..p.len()).map(weight).sum();
    if total <= 0.0 {
        return None;
    }
    let mut target = u.clamp(0.0, 1.0) * total;
    let mut last = None;
    for i in 0..p.len() {
        let w = weight(i);
        if w <= 0.0 {
            continue;
        }
        last = Some(i as u32);
        if target < w {
            return last;
        }
        target -= w;
    }
    last
}

/// Verifies one copy proposal against the target `p` (normalized): `(true, proposal)` when
/// accepted (probability `p(proposal)`, decided by `u_accept`), else `(false, y)` with `y`
/// drawn from `p` without the proposal (by `u_draw`). A target with no other mass keeps the
/// proposal.
pub fn verify(p: &[f64], proposal: u32, u_accept: f64, u_draw: f64) -> (bool, u32) {
    let px = p.get(proposal as usize).copied().unwrap_or(0.0).max(0.0);
    if u_accept < px {
        return (true, proposal);
    }
    match draw(p, u_draw, Some(proposal)) {
        Some(y) => (false, y),
        None => (true, proposal),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn splitmix(z: &mut u64) -> f64 {
        *z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut x = *z;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((x ^ (x >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Pearson's chi-square of `counts` against probabilities `p` (cells with p > 0).
    fn chi_square(counts: &[u64], p: &[f64]) -> (f64, usize) {
        let n: u64 = counts.iter().sum();
        let mut chi = 0.0;
        let mut cells = 0;
        for (c, &q) in counts.iter().zip(p) {
            if q > 0.0 {
                let e = n as f64 * q;
                chi += (*c as f64 - e).powi(2) / e;
                cells += 1;
            } else {
                assert_eq!(*c, 0, "a token of zero probability was emitted");
            }
        }
        (chi, cells - 1)
    }

    /// The 0.999 quantile of chi-square for `df` degrees of freedom (Wilson-Hilferty).
    fn critical(df: usize) -> f64 {
        let k = df as f64;
        let z = 3.090_232; // standard normal 0.999 quantile
        k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
    }

    #[test]
    fn one_verified_token_is_distributed_as_the_target() {
        let mut seed = 42u64;
        let targets: [&[f64]; 4] = [
            &[0.1, 0.2, 0.3, 0.15, 0.15, 0.1],
            &[0.7, 0.05, 0.05, 0.1, 0.05, 0.05],
            &[0.0, 0.5, 0.0, 0.25, 0.25, 0.0],
            &[1.0 / 6.0; 6],
        ];
        for p in targets {
            for proposal in 0..6u32 {
                let mut counts = [0u64; 6];
                let mut accepted = 0u64;
                let n = 60_000;
                for _ in 0..n {
                    let (a, t) = verify(p, proposal, splitmix(&mut seed), splitmix(&mut seed));
                    counts[t as usize] += 1;
                    accepted += u64::from(a);
                }
                let (chi, df) = chi_square(&counts, p);
                assert!(chi < critical(df), "p {p:?}, proposal {proposal}: chi-square {chi:.1} on {df} df");
                // Acceptance happens at rate p(proposal).
                let rate = accepted as f64 / n as f64;
                assert!(
                    (rate - p[proposal as usize]).abs() < 0.01,
                    "acceptance {rate} for p(x) {}",
                    p[proposal as usize]
                );
            }
        }
    }

    #[test]
    fn a_verified_chain_has_the_target_joint_distribution() {
        // Two positions; the second's distribution depends on the first token.
        let first = [0.5, 0.3, 0.2];
        let second = |t: u32| match t {
            0 => [0.1, 0.6, 0.3],
            1 => [0.4, 0.4, 0.2],
            _ => [0.0, 0.2, 0.8],
        };
        let mut seed = 7u64;
        for proposals in [[0u32, 1], [1, 1], [2, 0]] {
            let mut counts = [0u64; 9];
            for _ in 0..90_000 {
                let (a, t0) = verify(&first, proposals[0], splitmix(&mut seed), splitmix(&mut seed));
                let p1 = second(t0);
                let t1 = if a {
                    verify(&p1, proposals[1], splitmix(&mut seed), splitmix(&mut seed)).1
                } else {
                    // The correction ended this step; the next step draws the position plainly.
                    draw(&p1, splitmix(&mut seed), None).unwrap_or(0)
                };
                counts[(t0 * 3 + t1) as usize] += 1;
            }
            let joint: Vec<f64> = (0..9).map(|i| first[i / 3] * second((i / 3) as u32)[i % 3]).collect();
            let (chi, df) = chi_square(&counts, &joint);
            assert!(chi < critical(df), "proposals {proposals:?}: chi-square {chi:.1} on {df} df");
        }
    }

    #[test]
    fn a_point_mass_target_reproduces_greedy_decoding() {
        let greedy = [0.0, 0.0, 1.0, 0.0];
        for proposal in 0..4 {
            for u in [0.0, 0.3, 0.999] {
                let (accepted, token) = verify(&greedy, proposal, u, 1.0 - u);
                assert_eq!(token, 2);
                assert_eq!(accepted, proposal == 2);
            }
        }
    }
}
