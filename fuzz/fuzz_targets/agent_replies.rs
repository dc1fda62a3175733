//! The JSON the host reads from a sandbox's agent (`service/agent.rs`: spawn
//! replies, the command list, info, error bodies, exit statuses) on hostile bytes:
//! decode or refuse, and whatever decodes re-encodes and decodes the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use space_agent::protocol::{AgentInfo, CommandInfo, ErrorBody, ExitStatus, SpawnReply};

fn round_trip<T>(data: &[u8])
where
    T: serde::de::DeserializeOwned + serde::Serialize + PartialEq + std::fmt::Debug,
{
    if let Ok(v) = serde_json::from_slice::<T>(data) {
        let again = serde_json::to_vec(&v).expect("serialises");
        assert_eq!(serde_json::from_slice::<T>(&again).expect("round trip"), v);
    }
}

fuzz_target!(|data: &[u8]| {
    round_trip::<SpawnReply>(data);
    round_trip::<Vec<CommandInfo>>(data);
    round_trip::<AgentInfo>(data);
    round_trip::<ErrorBody>(data);
    round_trip::<ExitStatus>(data);
});
