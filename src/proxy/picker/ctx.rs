//! What every ext_proc stream of one listener shares: the node, its `[picker]` section and the
//! picker's metrics.

use std::sync::Arc;

use super::metrics::PickerMetrics;
use crate::node::config::PickerSection;
use crate::node::Node;

/// The shared context of a picker's streams (cheap to clone).
#[derive(Clone)]
pub struct PickerCtx {
    /// The node that decides.
    pub node: Arc<Node>,
    /// `[picker]`, as the node started with it.
    pub cfg: Arc<PickerSection>,
    /// The picker's metrics.
    pub metrics: PickerMetrics,
}
