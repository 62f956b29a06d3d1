//! placeholder
/// placeholder
#[derive(Debug)]
pub struct ReshardPlan;
