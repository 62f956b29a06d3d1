//! The TCP control channel under the names of earlier releases: [`NetChannel`] is
//! [`kvbridge_control::tcp::TcpControlChannel`] (wire format, bounds and examples there and in
//! docs/control-protocol.md).

pub use kvbridge_control::tcp::{
    FRAME_LEN_RANGE, MAX_ENDPOINT_LEN, TCP_CHANNEL_NAME as NET_CHANNEL_NAME,
    TCP_WIRE_VERSION as NET_PROTOCOL_VERSION, TcpControlChannel as NetChannel,
    TcpControlConfig as NetChannelConfig, TcpControlStats as NetChannelStats,
};
