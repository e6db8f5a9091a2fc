//! Evaluation instruments: workloads (the Mooncake trace and synthetic families), statistics, the
//! discrete-event simulator that replays workloads through the routing core and the engine model,
//! and `kvmesh bench`, which replays them over HTTP against live endpoints and reports.

pub mod bench_cli;
pub mod replay;
pub mod report;
pub mod sim;
pub mod sim_cli;
pub mod stats;
pub mod trace;
pub mod workload;
