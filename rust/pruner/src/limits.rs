//! Bounds on the work and memory of one request, checked before anything is allocated.
//!
//! A pruning request's cost grows with its shape and configuration: the search scores up to
//! `k + (levels - 1) * beam_width * k` paths (one arena node each) and the tree's attention
//! mask holds `(budget + 1)^2` cells. Without bounds one request (a `budget` of 2^32, a
//! `beam_width` of 10^7) can take every core for minutes or abort the process on a failed
//! allocation; with them it gets an error naming the limit. The defaults leave ample room for
//! real drafts (the reference configuration scores ~3,500 paths for a 60-node tree).

use serde::{Deserialize, Serialize};

use crate::error::{PrunerError, Result};

/// The largest request a [`crate::Pruner`] accepts. Each field names the setting that raises
/// it (the daemon's `--max-*` flag of the same name).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrunerLimits {
    /// Draft levels (rows of `topk_ids`) per request.
    pub max_levels: usize,
    /// Candidates per level (`k`).
    pub max_k: usize,
    /// A configuration's `beam_width`.
    pub max_beam_width: usize,
    /// A configuration's `max_nodes` and a request's `budget` (the tree's attention mask is
    /// `(nodes + 1)^2` cells).
    pub max_nodes: usize,
    /// Paths one search may score (one arena node each, ~60 bytes of scratch per path).
    pub max_scored_paths: usize,
}

impl Default for PrunerLimits {
    fn default() -> Self {
        PrunerLimits {
            max_levels: 64,
            max_k: 1024,
            max_beam_width: 1024,
            max_nodes: 1024,
            max_scored_paths: 1 << 20,
        }
    }
}

/// Paths a search over `levels` rows of `k` candidates with `beam_width` scores: every
/// candidate of level 0, then `min(beam_width, paths of the level above) * k` per level.
/// Saturates instead of overflowing. Constant time in `levels` (a hostile request may
/// declare billions): once a level keeps as many paths as the one above, every later level
/// scores the same number.
pub fn scored_paths(levels: usize, k: usize, beam_width: usize) -> usize {
    let mut total = 0usize;
    let mut above = 1usize; // the root
    for level in 0..levels {
        let kept = above.min(beam_width);
        let here = kept.saturating_mul(k);
        if here.min(beam_width) == kept {
            return total.saturating_add(here.saturating_mul(levels - level));
        }
        total = total.saturating_add(here);
        above = here;
    }
    total
}

impl PrunerLimits {
    /// Checks every field is at least 1.
    pub fn validate(&self) -> Result<()> {
        for (name, value) in self.fields() {
            if value == 0 {
                return Err(PrunerError::InvalidConfig(format!(
                    "limit {name} = 0; expected at least 1"
                )));
            }
        }
        Ok(())
    }

    fn fields(&self) -> [(&'static str, usize); 5] {
        [
            ("max_levels", self.max_levels),
            ("max_k", self.max_k),
            ("max_beam_width", self.max_beam_width),
            ("max_nodes", self.max_nodes),
            ("max_scored_paths", self.max_scored_paths),
        ]
    }

    /// A configuration's `beam_width` and `max_nodes` within the limits.
    pub fn check_config(&self, beam_width: usize, max_nodes: usize) -> Result<()> {
        check(
            "beam_width",
            beam_width,
            "max_beam_width",
            self.max_beam_width,
        )?;
        check("max_nodes", max_nodes, "max_nodes", self.max_nodes)
    }

    /// A request's shape and budget within the limits (the configuration already checked).
    pub fn check_request(
        &self,
        levels: usize,
        k: usize,
        budget: usize,
        beam_width: usize,
    ) -> Result<()> {
        check("levels", levels, "max_levels", self.max_levels)?;
        check("k", k, "max_k", self.max_k)?;
        check("budget", budget, "max_nodes", self.max_nodes)?;
        let paths = scored_paths(levels, k, beam_width);
        if paths > self.max_scored_paths {
            return Err(PrunerError::LimitExceeded {
                what: format!(
                    "levels x k x beam_width = {levels} x {k} x {beam_width} ({paths} scored \
                     paths)"
                ),
                limit_name: "max_scored_paths",
                limit: self.max_scored_paths,
            });
        }
        Ok(())
    }
}

fn check(what: &str, value: usize, limit_name: &'static str, limit: usize) -> Result<()> {
    if value > limit {
        return Err(PrunerError::LimitExceeded {
            what: format!("{what} = {value}"),
            limit_name,
            limit,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scored_paths_follow_the_beam() {
        assert_eq!(scored_paths(1, 25, 20), 25);
        // Level 1: 20 beams x 25; then the same per level.
        assert_eq!(scored_paths(3, 25, 20), 25 + 500 + 500);
        // A beam wider than the paths above it is limited by them.
        assert_eq!(scored_paths(3, 2, 100), 2 + 4 + 8);
        assert_eq!(scored_paths(64, usize::MAX, usize::MAX), usize::MAX);
        assert_eq!(scored_paths(0, 25, 20), 0);
        assert_eq!(scored_paths(usize::MAX, 0, 20), 0);
        assert_eq!(scored_paths(usize::MAX, 1, 20), usize::MAX);
        assert_eq!(scored_paths(1 << 40, 3, 9), 3 + 9 + 27 * ((1 << 40) - 2));
    }

    proptest::proptest! {
        #[test]
        fn scored_paths_equal_the_level_by_level_sum(
            levels in 0usize..40,
            k in 0usize..300,
            beam_width in 1usize..2000,
        ) {
            let (mut total, mut above) = (0usize, 1usize);
            for _ in 0..levels {
                let here = above.min(beam_width).saturating_mul(k);
                total = total.saturating_add(here);
                above = here;
            }
            proptest::prop_assert_eq!(scored_paths(levels, k, beam_width), total);
        }
    }

    #[test]
    fn each_limit_is_named_when_exceeded() {
        let l = PrunerLimits::default();
        l.validate().unwrap();
        l.check_config(1024, 1024).unwrap();
        l.check_request(64, 16, 1024, 1024).unwrap();
        let cases = [
            (l.check_config(1025, 60), "max_beam_width"),
            (l.check_config(20, 1025), "max_nodes"),
            (l.check_request(65, 25, 60, 20), "max_levels"),
            (l.check_request(8, 1025, 60, 20), "max_k"),
            (l.check_request(8, 25, 1 << 32, 20), "max_nodes"),
            (l.check_request(64, 1024, 60, 1024), "max_scored_paths"),
        ];
        for (result, name) in cases {
            let err = result.unwrap_err();
            assert!(matches!(err, PrunerError::LimitExceeded { .. }), "{err:?}");
            assert!(err.to_string().contains(name), "{err} should name {name}");
        }
        let zero = PrunerLimits {
            max_k: 0,
            ..Default::default()
        };
        assert!(zero.validate().unwrap_err().to_string().contains("max_k"));
    }
}
