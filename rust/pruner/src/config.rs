//! Pruner configuration. Defaults are the reference implementation's values.

use serde::{Deserialize, Serialize};

use crate::error::{PrunerError, Result};

/// Every constant of the beam search.
///
/// The score increment of a candidate token `t` at level `l` (0-based) below path `P` is
/// `w_level(l) * (w_logit(l) * ln(p + eps) + ngram_weight * ln(p_ngram + eps))` with
/// `w_level(l) = (l + 1)^-level_exponent` and `w_logit(l) = logit_decay^l`; the n-gram term is
/// left out at level 0 unless `ngram_at_level0`, and everywhere when `ngram_weight == 0`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrunerConfig {
    /// How many draft candidates per level callers should pass (the `k` of `topk_ids`). The
    /// pruner itself uses whatever `k` a request carries.
    pub top_k: usize,
    /// Paths kept per level to be extended at the next level.
    pub beam_width: usize,
    /// Nodes kept in the tree, the root not counted (a request's `budget` overrides it).
    pub max_nodes: usize,
    /// `w_level(l) = (l + 1)^-level_exponent`.
    pub level_exponent: f64,
    /// `w_logit(l) = logit_decay^l`.
    pub logit_decay: f64,
    /// Weight of `ln(p_ngram + eps)`; 0 disables n-gram lookups entirely.
    pub ngram_weight: f64,
    /// Whether level 0 gets the n-gram term too (the reference: no).
    pub ngram_at_level0: bool,
    /// Token whose paths rank last in the beam; `None` = the n-gram model's EOS (if any).
    pub eos_id: Option<u32>,
    /// Added to every probability before the logarithm.
    pub eps: f64,
}

impl Default for PrunerConfig {
    fn default() -> Self {
        PrunerConfig {
            top_k: 25,
            beam_width: 20,
            max_nodes: 60,
            level_exponent: 0.7,
            logit_decay: 0.9,
            ngram_weight: 0.5,
            ngram_at_level0: false,
            eos_id: None,
            eps: 1e-10,
        }
    }
}

impl PrunerConfig {
    /// Checks every field's domain.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(PrunerError::InvalidConfig(msg));
        if self.top_k == 0 {
            return bad("top_k = 0; expected at least 1".into());
        }
        if self.beam_width == 0 {
            return bad("beam_width = 0; expected at least 1".into());
        }
        if self.max_nodes == 0 {
            return bad("max_nodes = 0; expected at least 1".into());
        }
        if !self.level_exponent.is_finite() {
            return bad(format!(
                "level_exponent = {}; expected a finite number",
                self.level_exponent
            ));
        }
        if !(self.logit_decay.is_finite() && self.logit_decay >= 0.0) {
            return bad(format!(
                "logit_decay = {}; expected a finite number >= 0",
                self.logit_decay
            ));
        }
        if !(self.ngram_weight.is_finite() && self.ngram_weight >= 0.0) {
            return bad(format!(
                "ngram_weight = {}; expected a finite number >= 0",
                self.ngram_weight
            ));
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad(format!(
                "eps = {}; expected a finite number > 0 (ln(0) would make scores -inf)",
                self.eps
            ));
        }
        Ok(())
    }

    /// `w_level(l)`.
    #[inline]
    pub fn level_weight(&self, level: usize) -> f64 {
        ((level + 1) as f64).powf(-self.level_exponent)
    }

    /// `w_logit(l)`. `powf`, not `powi`: the same libm call as Python's `float ** float`, so
    /// an independent implementation reproduces the scores bit for bit.
    #[inline]
    pub fn logit_weight(&self, level: usize) -> f64 {
        self.logit_decay.powf(level as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_reference_values() {
        let c = PrunerConfig::default();
        assert_eq!((c.top_k, c.beam_width, c.max_nodes), (25, 20, 60));
        assert_eq!(
            (c.level_exponent, c.logit_decay, c.ngram_weight),
            (0.7, 0.9, 0.5)
        );
        assert!(!c.ngram_at_level0);
        assert_eq!(c.eos_id, None);
        assert_eq!(c.eps, 1e-10);
        c.validate().unwrap();
        assert_eq!(c.level_weight(0), 1.0);
        assert_eq!(c.logit_weight(0), 1.0);
        assert!((c.level_weight(1) - 2f64.powf(-0.7)).abs() < 1e-15);
        assert!((c.logit_weight(2) - 0.81).abs() < 1e-12);
    }

    #[test]
    fn every_bad_field_is_rejected_by_name() {
        let cases: Vec<(PrunerConfig, &str)> = vec![
            (
                PrunerConfig {
                    top_k: 0,
                    ..Default::default()
                },
                "top_k",
            ),
            (
                PrunerConfig {
                    beam_width: 0,
                    ..Default::default()
                },
                "beam_width",
            ),
            (
                PrunerConfig {
                    max_nodes: 0,
                    ..Default::default()
                },
                "max_nodes",
            ),
            (
                PrunerConfig {
                    level_exponent: f64::NAN,
                    ..Default::default()
                },
                "level_exponent",
            ),
            (
                PrunerConfig {
                    logit_decay: -0.1,
                    ..Default::default()
                },
                "logit_decay",
            ),
            (
                PrunerConfig {
                    ngram_weight: f64::INFINITY,
                    ..Default::default()
                },
                "ngram_weight",
            ),
            (
                PrunerConfig {
                    eps: 0.0,
                    ..Default::default()
                },
                "eps",
            ),
        ];
        for (config, field) in cases {
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains(field), "{err} should name {field}");
        }
    }

    #[test]
    fn serde_round_trip_partial_input_and_unknown_fields() {
        let c = PrunerConfig {
            beam_width: 7,
            eos_id: Some(2),
            ..Default::default()
        };
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<PrunerConfig>(&json).unwrap(), c);
        // Missing fields take the reference defaults.
        let partial: PrunerConfig = serde_json::from_str(r#"{"max_nodes": 16}"#).unwrap();
        assert_eq!(
            partial,
            PrunerConfig {
                max_nodes: 16,
                ..Default::default()
            }
        );
        // A misspelt field is an error, not a silently ignored setting.
        let err = serde_json::from_str::<PrunerConfig>(r#"{"beam_widht": 3}"#).unwrap_err();
        assert!(err.to_string().contains("beam_widht"), "{err}");
    }
}
