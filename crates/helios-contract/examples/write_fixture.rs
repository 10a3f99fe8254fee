//! Writes a fixture core: `cargo run -p helios-contract --example write_fixture -- DIR [abi]`.
//! Used once per ABI to create the checked-in compatibility cores.

use helios_contract::fixtures::{Fixture, FixtureSpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().ok_or("usage: write_fixture DIR [ABI]")?;
    let abi: u32 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(helios_contract::CURRENT_ABI);
    let spec = FixtureSpec { abi, ..FixtureSpec::default() };
    Fixture::build(&spec).write_to(std::path::Path::new(&dir))?;
    println!("wrote ABI {abi} fixture core to {dir}");
    Ok(())
}
