//! What a comparison judges its runs by: a classifier's test accuracy (higher is better, a
//! target accuracy) — a regression's R², which its summaries keep in the accuracy's place — or a
//! language model's validation loss (lower is better) and its units, tokens rather than samples.
//!
//! A language model's runs carry no common target loss, so the report sets its own: within
//! [`LOSS_TOLERANCE`] of the lowest final validation loss any run of the comparison reached.
//! Time to target is then the training time of a run's first evaluation at or below it.

use ringtmp_metrics::Summary;

/// How far above the best final validation loss still counts as the same loss: 2% (the
/// issue's "within 2% of loss", the counterpart of half a point of accuracy).
pub const LOSS_TOLERANCE: f64 = 0.02;

/// Half a point of accuracy: how far below the best final accuracy still counts as the same.
const ACCURACY_TOLERANCE: f64 = 0.005;

/// The yardstick of one comparison.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Quality {
    /// Test accuracy, against the runs' target accuracy; a regression's R² against its target.
    Accuracy {
        /// The target accuracy (a fraction), or R².
        target: f64,
        /// Whether the runs are regressions (the value is R², shown as such).
        regression: bool,
    },
    /// Validation loss (nats per token), against the report's target loss.
    Loss {
        /// The target loss.
        target: f64,
        /// Positions (tokens) per sample.
        positions: f64,
    },
}

impl Quality {
    /// The yardstick of `summaries`: validation loss when every run trained a language model.
    pub fn of(summaries: &[&Summary]) -> Self {
        let languages: Option<Vec<_>> = summaries.iter().map(|s| s.language.as_ref()).collect();
        match languages {
            Some(l) if !l.is_empty() => {
                let best = l
                    .iter()
                    .map(|l| l.final_val_loss)
                    .filter(|v| v.is_finite())
                    .fold(f64::INFINITY, f64::min);
                Self::Loss {
                    target: best * (1.0 + LOSS_TOLERANCE),
                    positions: f64::from(l[0].seq_len.max(1)),
                }
            }
            _ => Self::Accuracy {
                target: summaries.first().map_or(0.97, |s| s.target_accuracy),
                regression: !summaries.is_empty()
                    && summaries.iter().all(|s| s.regression.is_some()),
            },
        }
    }

    /// The run's final value.
    pub fn final_value(&self, s: &Summary) -> f64 {
        match self {
            Self::Accuracy { .. } => s.final_test_accuracy,
            Self::Loss { .. } => s.language.as_ref().map_or(f64::NAN, |l| l.final_val_loss),
        }
    }

    /// The run's best value of any evaluation.
    pub fn best_value(&self, s: &Summary) -> f64 {
        match self {
            Self::Accuracy { .. } => s.best_test_accuracy,
            Self::Loss { .. } => s.language.as_ref().map_or(f64::NAN, |l| l.best_val_loss),
        }
    }

    /// The evaluation event's field the curves plot.
    pub fn curve_field(&self) -> &'static str {
        match self {
            Self::Accuracy { .. } => "test_accuracy",
            Self::Loss { .. } => "test_loss",
        }
    }

    /// Training seconds to the target: the run's own (accuracy), or its first evaluation at or
    /// below the target loss on its `curve` of (training seconds, samples, loss).
    pub fn time_to_target(&self, s: &Summary, curve: &[(f64, f64, f64)]) -> Option<f64> {
        match self {
            Self::Accuracy { .. } => s.time_to_target_seconds,
            Self::Loss { target, .. } => curve.iter().find(|p| p.2 <= *target).map(|p| p.0),
        }
    }

    /// The best of `values`.
    pub fn best_of(&self, values: impl Iterator<Item = f64>) -> Option<f64> {
        let values = values.filter(|v| v.is_finite());
        match self {
            Self::Accuracy { .. } => values.reduce(f64::max),
            Self::Loss { .. } => values.reduce(f64::min),
        }
    }

    /// An ordering key: lower is better.
    pub fn rank(&self, value: Option<f64>) -> f64 {
        match (self, value) {
            (Self::Accuracy { .. }, Some(a)) => -a,
            (Self::Loss { .. }, Some(l)) if l.is_finite() => l,
            _ => f64::INFINITY,
        }
    }

    /// Whether `value` is as good as `best`, within the tolerance.
    pub fn as_good_as(&self, value: f64, best: f64) -> bool {
        match self {
            Self::Accuracy { .. } => value >= best - ACCURACY_TOLERANCE,
            Self::Loss { .. } => value <= best * (1.0 + LOSS_TOLERANCE),
        }
    }

    /// A value as the report prints it: a percentage, or a loss to 3 decimals.
    pub fn show(&self, value: f64) -> String {
        match self {
            Self::Accuracy {
                regression: true, ..
            } => format!("R² {value:.4}"),
            Self::Accuracy { .. } => format!("{:.2}%", value * 100.0),
            Self::Loss { .. } => format!("{value:.3}"),
        }
    }

    /// (digits, scale) of a value in the table.
    pub fn digits_and_scale(&self) -> (usize, f64) {
        match self {
            Self::Accuracy {
                regression: true, ..
            } => (4, 1.0),
            Self::Accuracy { .. } => (2, 100.0),
            Self::Loss { .. } => (3, 1.0),
        }
    }

    /// The target as the report says it.
    pub fn target_text(&self) -> String {
        match self {
            Self::Accuracy {
                target,
                regression: true,
            } => format!("R² {target:.3}"),
            Self::Accuracy { target, .. } => format!("{:.0}%", target * 100.0),
            Self::Loss { target, .. } => format!("loss {target:.3}"),
        }
    }

    /// What is measured: `accuracy` or `validation loss`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Accuracy {
                regression: true, ..
            } => "R²",
            Self::Accuracy { .. } => "accuracy",
            Self::Loss { .. } => "validation loss",
        }
    }

    /// The unit throughput and traffic are counted in: `sample` or `token`.
    pub fn unit(&self) -> &'static str {
        match self {
            Self::Accuracy { .. } => "sample",
            Self::Loss { .. } => "token",
        }
    }

    /// Units per sample: 1, or a language model's positions per window.
    pub fn per_sample(&self) -> f64 {
        match self {
            Self::Accuracy { .. } => 1.0,
            Self::Loss { positions, .. } => *positions,
        }
    }

    /// A curve point's value as plotted: a percentage, or the loss.
    pub fn plotted(&self, value: f64) -> f64 {
        match self {
            Self::Accuracy {
                regression: true, ..
            } => value,
            Self::Accuracy { .. } => value * 100.0,
            Self::Loss { .. } => value,
        }
    }

    /// The plots' axis label for the value.
    pub fn axis(&self) -> &'static str {
        match self {
            Self::Accuracy {
                regression: true, ..
            } => "test R²",
            Self::Accuracy { .. } => "test accuracy (%)",
            Self::Loss { .. } => "validation loss (nats per token)",
        }
    }
}

#[cfg(test)]
mod tests {
    use ringtmp_metrics::LanguageSummary;

    use super::*;

    fn lm(final_val_loss: f64) -> Summary {
        Summary {
            language: Some(LanguageSummary {
                seq_len: 64,
                final_val_loss,
                best_val_loss: final_val_loss,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn regressions_are_judged_by_r2_shown_as_such() {
        let r = Summary {
            target_accuracy: 0.9,
            final_test_accuracy: 0.95,
            regression: Some(ringtmp_metrics::RegressionSummary::default()),
            ..Default::default()
        };
        let q = Quality::of(&[&r, &r]);
        assert_eq!(
            q,
            Quality::Accuracy {
                target: 0.9,
                regression: true
            }
        );
        assert_eq!(q.show(0.95), "R² 0.9500");
        assert_eq!(q.target_text(), "R² 0.900");
        assert_eq!((q.name(), q.plotted(0.95)), ("R²", 0.95));
        // Mixed with a classifier, the report stays in accuracy.
        let c = Summary::default();
        assert!(matches!(
            Quality::of(&[&r, &c]),
            Quality::Accuracy {
                regression: false,
                ..
            }
        ));
    }

    #[test]
    fn a_language_models_target_is_within_two_percent_of_the_best_loss() {
        let (a, b) = (lm(2.0), lm(1.9));
        let q = Quality::of(&[&a, &b]);
        assert_eq!(
            q,
            Quality::Loss {
                target: 1.9 * 1.02,
                positions: 64.0
            }
        );
        let curve = [(10.0, 0.0, 2.5), (20.0, 0.0, 1.93), (30.0, 0.0, 1.9)];
        assert_eq!(q.time_to_target(&a, &curve), Some(20.0));
        assert!(q.as_good_as(1.93, 1.9) && !q.as_good_as(1.95, 1.9));
        assert_eq!(q.best_of([2.0, 1.9, f64::NAN].into_iter()), Some(1.9));
        assert!(q.rank(Some(1.9)) < q.rank(Some(2.0)));
        // A classifier keeps accuracy, higher being better.
        let c = Summary {
            target_accuracy: 0.9,
            ..Default::default()
        };
        let q = Quality::of(&[&c, &a]);
        assert_eq!(
            q,
            Quality::Accuracy {
                target: 0.9,
                regression: false
            }
        );
        assert!(q.rank(Some(0.95)) < q.rank(Some(0.9)));
        assert!(q.as_good_as(0.946, 0.95) && !q.as_good_as(0.94, 0.95));
    }
}
