//! The draft tree as flat arrays, laid out for the target's verification forward.
//!
//! Element types are the ones Python receives (int64 indices, bool mask, f64 scores) so the
//! bindings hand the vectors to numpy without converting or copying them.

/// A pruned draft tree. Node 0 is the root (the token just sampled); nodes are ordered by
/// depth, then score descending, then path (token ids, root to node) ascending, so every
/// parent precedes its children.
#[derive(Clone, Debug, PartialEq)]
pub struct DraftTree {
    /// Token of each node; `tokens[0]` = the last context token.
    pub tokens: Vec<i64>,
    /// Index of each node's parent; `-1` for the root.
    pub parents: Vec<i64>,
    /// Depth of each node (root 0) = its position offset after the root.
    pub depths: Vec<i64>,
    /// `len() x len()` row-major: `[i * len + j]` is true when node `i` may attend to node `j`
    /// (`j` is `i` or one of its ancestors, the root included).
    pub attention_mask: Vec<bool>,
    /// `num_leaves() x retrieve_width()` row-major: one row per leaf (a node without
    /// children), in node-index order, listing node indices root to leaf, padded with -1.
    pub retrieve_indices: Vec<i64>,
    /// Cumulative score of each node (root 0).
    pub scores: Vec<f64>,
    num_leaves: usize,
    retrieve_width: usize,
}

impl DraftTree {
    /// Builds the mask and retrieve indices. `parents[i] < i` for every non-root node and
    /// `depths[i] = depths[parents[i]] + 1` (the beam search guarantees both).
    pub(crate) fn from_nodes(
        tokens: Vec<i64>,
        parents: Vec<i64>,
        depths: Vec<i64>,
        scores: Vec<f64>,
    ) -> DraftTree {
        let n = tokens.len();
        debug_assert!(n >= 1 && parents.len() == n && depths.len() == n && scores.len() == n);
        let mut attention_mask = vec![false; n * n];
        let mut has_child = vec![false; n];
        for i in 0..n {
            // A node sees what its parent sees, plus itself.
            if let Ok(p) = usize::try_from(parents[i]) {
                debug_assert!(p < i);
                attention_mask.copy_within(p * n..p * n + n, i * n);
                has_child[p] = true;
            }
            attention_mask[i * n + i] = true;
        }
        let max_depth = depths.iter().copied().max().unwrap_or(0) as usize;
        let width = max_depth + 1;
        let num_leaves = has_child.iter().filter(|&&c| !c).count();
        let mut retrieve_indices = vec![-1i64; num_leaves * width];
        for (row, leaf) in (0..n).filter(|&i| !has_child[i]).enumerate() {
            let mut node = leaf as i64;
            while node >= 0 {
                let u = node as usize;
                retrieve_indices[row * width + depths[u] as usize] = node;
                node = parents[u];
            }
        }
        DraftTree {
            tokens,
            parents,
            depths,
            attention_mask,
            retrieve_indices,
            scores,
            num_leaves,
            retrieve_width: width,
        }
    }

    /// Number of nodes, the root included.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Never true: a tree always has its root.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Number of draft nodes (the root not counted).
    pub fn num_draft_nodes(&self) -> usize {
        self.len() - 1
    }

    /// Rows of `retrieve_indices`.
    pub fn num_leaves(&self) -> usize {
        self.num_leaves
    }

    /// Columns of `retrieve_indices` (= deepest depth + 1).
    pub fn retrieve_width(&self) -> usize {
        self.retrieve_width
    }

    /// Deepest node's depth.
    pub fn max_depth(&self) -> usize {
        self.retrieve_width - 1
    }

    /// Whether node `i` may attend to node `j`.
    pub fn mask(&self, i: usize, j: usize) -> bool {
        self.attention_mask[i * self.len() + j]
    }

    /// Row `r` of `retrieve_indices`.
    pub fn retrieve_row(&self, r: usize) -> &[i64] {
        &self.retrieve_indices[r * self.retrieve_width..(r + 1) * self.retrieve_width]
    }

    /// The path of node `i`: token ids from the root's child down to `i` (empty for the root).
    pub fn path(&self, i: usize) -> Vec<i64> {
        let mut path = Vec::with_capacity(self.depths[i] as usize);
        let mut node = i as i64;
        while node > 0 {
            path.push(self.tokens[node as usize]);
            node = self.parents[node as usize];
        }
        path.reverse();
        path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    //   0
    //  / \
    // 1   2
    // |
    // 3
    fn small() -> DraftTree {
        DraftTree::from_nodes(
            vec![10, 11, 12, 13],
            vec![-1, 0, 0, 1],
            vec![0, 1, 1, 2],
            vec![0.0, -0.1, -0.2, -0.3],
        )
    }

    #[test]
    fn mask_is_self_and_ancestors() {
        let t = small();
        let expected = [
            [true, false, false, false],
            [true, true, false, false],
            [true, false, true, false],
            [true, true, false, true],
        ];
        for (i, row) in expected.iter().enumerate() {
            for (j, &e) in row.iter().enumerate() {
                assert_eq!(t.mask(i, j), e, "mask[{i}][{j}]");
            }
        }
    }

    #[test]
    fn retrieve_rows_are_leaves_in_index_order_padded() {
        let t = small();
        assert_eq!(
            (t.num_leaves(), t.retrieve_width(), t.max_depth()),
            (2, 3, 2)
        );
        assert_eq!(t.retrieve_row(0), &[0, 2, -1]);
        assert_eq!(t.retrieve_row(1), &[0, 1, 3]);
        assert_eq!(t.path(3), vec![11, 13]);
        assert_eq!(t.path(0), Vec::<i64>::new());
        assert_eq!((t.len(), t.num_draft_nodes(), t.is_empty()), (4, 3, false));
    }

    #[test]
    fn root_only_tree_is_its_own_leaf() {
        let t = DraftTree::from_nodes(vec![5], vec![-1], vec![0], vec![0.0]);
        assert_eq!(t.retrieve_indices, vec![0]);
        assert_eq!(t.attention_mask, vec![true]);
    }
}
