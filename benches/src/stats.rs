//! The statistics every section uses: the median, the spread of repeated measurements, and
//! bandwidth in GB/s.

use serde::{Deserialize, Serialize};

use crate::report::Value;

/// The median of `values` (at least one): the middle value, or the mean of the two middle
/// values for an even count.
pub fn median(mut values: Vec<f64>) -> f64 {
    assert!(!values.is_empty(), "a median of nothing");
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// Bandwidth in GB/s (1 GB/s = 10⁹ bytes per second) of `bytes` moved in `seconds`.
pub fn gbps(bytes: usize, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

/// The spread of repeated measurements: the smallest, the median and the largest.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    /// Smallest.
    pub min: f64,
    /// Median (the mean of the middle two for an even count).
    pub median: f64,
    /// Largest.
    pub max: f64,
}

impl Spread {
    /// The spread of `values` (at least one).
    pub fn of(values: Vec<f64>) -> Self {
        assert!(!values.is_empty(), "a spread of nothing");
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        Self {
            min,
            median: median(values),
            max,
        }
    }

    /// Three cells: min, median, max, with `decimals` decimals.
    pub fn cells(self, decimals: usize) -> [Value; 3] {
        [
            Value::Num(self.min, decimals),
            Value::Num(self.median, decimals),
            Value::Num(self.max, decimals),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_is_the_middle_or_the_mean_of_the_two_middle_values() {
        assert_eq!(median(vec![5.0, 1.0, 3.0]), 3.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(vec![7.0]), 7.0);
        assert_eq!(median(vec![2.0, 1.0]), 1.5);
    }

    #[test]
    #[should_panic(expected = "nothing")]
    fn there_is_no_median_of_nothing() {
        median(Vec::new());
    }

    #[test]
    fn spreads_sort_and_take_the_middle() {
        let spread = Spread::of(vec![5.0, 1.0, 3.0]);
        assert_eq!((spread.min, spread.median, spread.max), (1.0, 3.0, 5.0));
        assert_eq!(Spread::of(vec![4.0, 1.0, 2.0, 3.0]).median, 2.5);
        assert_eq!(
            Spread::of(vec![2.0]).cells(1),
            [Value::Num(2.0, 1), Value::Num(2.0, 1), Value::Num(2.0, 1)]
        );
    }

    #[test]
    fn gigabytes_are_a_billion_bytes_per_second() {
        assert_eq!(gbps(1_000_000_000, 1.0), 1.0);
        assert_eq!(gbps(1 << 30, 0.5), 2.147_483_648);
        assert_eq!(gbps(50_000, 1e-6), 50.0);
    }
}
