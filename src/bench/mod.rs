//! Evaluation instruments: workloads (the Mooncake trace), statistics, and the discrete-event
//! simulator that replays workloads through the routing core and the engine model.

pub mod sim;
pub mod sim_cli;
pub mod stats;
pub mod trace;
