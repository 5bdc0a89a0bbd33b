//! The protocols by which a slice of a plan crosses a FIFO.

/// How a FIFO publishes its slots, as in NCCL (the transport's FIFOs,
/// `crate::transport::fifo`, describe both): a plan's operation carries one, and the cost
/// model chooses it per call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Protocol {
    /// Data, byte count, then the `head` counter: full bandwidth.
    #[default]
    Simple,
    /// A flag in every 8-byte line: low latency, half the bandwidth.
    LL,
}

impl Protocol {
    /// Every protocol, in the order the cost model prefers on ties.
    pub const ALL: [Protocol; 2] = [Protocol::Simple, Protocol::LL];

    /// Its position in [`Protocol::ALL`], for tables kept per protocol.
    pub fn index(&self) -> usize {
        match self {
            Protocol::Simple => 0,
            Protocol::LL => 1,
        }
    }

    /// NCCL's name for it (`Simple`, `LL`).
    pub fn name(&self) -> &'static str {
        match self {
            Protocol::Simple => "Simple",
            Protocol::LL => "LL",
        }
    }
}
