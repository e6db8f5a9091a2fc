//! Evaluation instruments: workloads (the Mooncake trace and synthetic families), statistics, the
//! discrete-event simulator that replays workloads through the routing core and the engine model,
//! and `kvmesh bench`, which replays them over HTTP against live endpoints and reports.

pub mod bench_cli;
pub mod decision_view;
pub mod delay_line;
pub mod demo;
pub mod fleet;
pub mod fleet_pd;
pub mod fuzz;
pub mod gateway;
pub mod hot_args;
pub mod replay;
pub mod replay_api;
pub mod report;
pub mod sim;
pub mod sim_bound;
pub mod sim_bytes;
pub mod sim_classes;
pub mod sim_cli;
pub mod sim_config;
mod sim_exact;
pub mod sim_fetch_table;
pub mod sim_gossip;
pub mod sim_pd;
pub mod stats;
pub mod tenant_args;
pub mod tier_args;
pub mod trace;
pub mod workload;
