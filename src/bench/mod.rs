//! Evaluation instruments: workloads (the Mooncake trace and synthetic families), and the
//! discrete-event simulator that replays them through the routing core.

pub mod trace;
