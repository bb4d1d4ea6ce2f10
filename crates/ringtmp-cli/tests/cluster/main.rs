//! Multi-process runs on loopback: the local launcher, and nodes started by hand the way an
//! external launcher starts them, with killed, stopped and unauthenticated nodes. Every child is
//! bounded by a deadline and killed if it outlives it. One test binary, a module per topic.

mod common;
mod compare;
mod namespaces;
mod recovery;
mod resources;
mod runtime;
mod strategies;
