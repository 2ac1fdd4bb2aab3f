//! Least-squares fits of prefill time against prompt tokens. Pure.

/// `t = fixed + tokens / rate + attention · tokens²`, and what it means for the router.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fit {
    /// `1 / b`: the rate of the linear layers, what a very short prompt would see per token.
    pub rate: f64,
    /// Seconds per request, whatever its length (clamped at 0).
    pub fixed_s: f64,
    /// Seconds per token²: prefill attention, each new token attending to the ones before.
    pub attention_s: f64,
    /// `typical / (t(typical) - fixed)`: prompt tokens per second at the typical length, fixed
    /// cost excluded. What the router should divide pending prompt tokens by.
    pub rate_at_typical: f64,
    pub typical_tokens: f64,
    /// The straight-line fit `t = fixed + tokens / rate` over the same points.
    pub linear: LinearFit,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearFit {
    pub rate: f64,
    pub fixed_s: f64,
    /// Coefficient of determination.
    pub r2: f64,
}

/// Solves `a x = b` (3x3) by Gaussian elimination with partial pivoting.
fn solve3(mut a: [[f64; 3]; 3], mut b: [f64; 3]) -> Option<[f64; 3]> {
    for col in 0..3 {
        let pivot = (col..3).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-300 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        for row in col + 1..3 {
            let f = a[row][col] / a[col][col];
            let pivot_row = a[col];
            for (v, p) in a[row].iter_mut().zip(pivot_row).skip(col) {
                *v -= f * p;
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; 3];
    for row in (0..3).rev() {
        let s: f64 = (row + 1..3).map(|k| a[row][k] * x[k]).sum();
        x[row] = (b[row] - s) / a[row][row];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

/// `(intercept, slope, r²)` of `t` on `n`.
fn line(points: &[(f64, f64)]) -> Option<(f64, f64, f64)> {
    let count = points.len() as f64;
    let mean_n = points.iter().map(|p| p.0).sum::<f64>() / count;
    let mean_t = points.iter().map(|p| p.1).sum::<f64>() / count;
    let snn: f64 = points.iter().map(|p| (p.0 - mean_n).powi(2)).sum();
    let snt: f64 = points.iter().map(|p| (p.0 - mean_n) * (p.1 - mean_t)).sum();
    let stt: f64 = points.iter().map(|p| (p.1 - mean_t).powi(2)).sum();
    if snn <= 0.0 {
        return None;
    }
    let slope = snt / snn;
    let r2 = if stt > 0.0 {
        snt * snt / (snn * stt)
    } else {
        1.0
    };
    Some((mean_t - slope * mean_n, slope, r2))
}

/// Fits `(tokens, seconds)` points; `None` with fewer than three distinct lengths or a fit that
/// makes no sense (time not growing with tokens).
pub fn fit(points: &[(f64, f64)], typical_tokens: f64) -> Option<Fit> {
    let mut lengths: Vec<f64> = points.iter().map(|p| p.0).collect();
    lengths.sort_by(f64::total_cmp);
    lengths.dedup();
    if lengths.len() < 3 || !points.iter().all(|p| p.0.is_finite() && p.1.is_finite()) {
        return None;
    }
    let (fixed, slope, r2) = line(points)?;
    if slope <= 0.0 {
        return None;
    }
    let linear = LinearFit {
        rate: 1.0 / slope,
        fixed_s: fixed.max(0.0),
        r2,
    };
    // in thousands of tokens, for conditioning
    let mut a = [[0.0; 3]; 3];
    let mut b = [0.0; 3];
    for &(n, t) in points {
        let x = [1.0, n / 1e3, (n / 1e3).powi(2)];
        for i in 0..3 {
            for j in 0..3 {
                a[i][j] += x[i] * x[j];
            }
            b[i] += x[i] * t;
        }
    }
    let (mut c0, mut per_token, mut attention) = match solve3(a, b) {
        Some([c, p, q]) => (c, p / 1e3, q / 1e6),
        None => (fixed, slope, 0.0),
    };
    if attention < 0.0 || per_token <= 0.0 {
        // no curvature to speak of (or noise): the straight line
        (c0, per_token, attention) = (fixed, slope, 0.0);
    }
    let typical = typical_tokens.max(1.0);
    Some(Fit {
        rate: 1.0 / per_token,
        fixed_s: c0.max(0.0),
        attention_s: attention,
        rate_at_typical: 1.0 / (per_token + attention * typical),
        typical_tokens: typical,
        linear,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovers_a_quadratic_exactly() {
        let model = |n: f64| 0.007 + n / 25_000.0 + 6.5e-10 * n * n;
        let points: Vec<_> = [256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0]
            .iter()
            .map(|&n| (n, model(n)))
            .collect();
        let f = fit(&points, 2048.0).unwrap();
        assert!((f.rate / 25_000.0 - 1.0).abs() < 1e-6, "{f:?}");
        assert!((f.fixed_s - 0.007).abs() < 1e-9, "{f:?}");
        assert!((f.attention_s / 6.5e-10 - 1.0).abs() < 1e-6, "{f:?}");
        let at = 2048.0 / (model(2048.0) - 0.007);
        assert!((f.rate_at_typical / at - 1.0).abs() < 1e-6, "{f:?}");
        // the straight line is pulled down by the long prompts
        assert!(
            f.linear.rate < 0.9 * 25_000.0 && f.linear.r2 > 0.99,
            "{f:?}"
        );
    }

    #[test]
    fn a_straight_line_has_no_attention() {
        let points: Vec<_> = (1..=6)
            .flat_map(|i| {
                let n = 500.0 * f64::from(i);
                [(n, 0.01 + n / 8000.0 + 1e-4), (n, 0.01 + n / 8000.0 - 1e-4)]
            })
            .collect();
        let f = fit(&points, 2048.0).unwrap();
        assert!((f.rate / 8000.0 - 1.0).abs() < 0.01, "{f:?}");
        assert!((f.linear.rate / 8000.0 - 1.0).abs() < 0.01, "{f:?}");
        assert!(f.attention_s < 1e-9);
    }

    #[test]
    fn too_few_lengths_or_nonsense_give_nothing() {
        assert_eq!(fit(&[], 1.0), None);
        assert_eq!(fit(&[(1.0, 1.0), (2.0, 2.0), (2.0, 2.1)], 1.0), None);
        let falling = [(1.0, 3.0), (2.0, 2.0), (3.0, 1.0)];
        assert_eq!(fit(&falling, 1.0), None);
        assert_eq!(fit(&[(1.0, 1.0), (2.0, f64::NAN), (3.0, 3.0)], 1.0), None);
        assert!(solve3([[0.0; 3]; 3], [1.0; 3]).is_none());
    }
}
