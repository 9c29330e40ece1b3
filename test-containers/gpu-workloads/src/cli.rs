//! Flag parsing for the workloads: `--flag value` or `--flag=value`, nothing else.

/// Which GPUs a workload uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Devices {
    All,
    List(Vec<i32>),
}

impl Devices {
    pub fn parse(s: &str) -> Result<Devices, String> {
        if s == "all" {
            return Ok(Devices::All);
        }
        let mut v = Vec::new();
        for part in s.split(',') {
            let d: i32 = part
                .trim()
                .parse()
                .map_err(|_| format!("--devices: bad device ordinal {part:?} in {s:?}"))?;
            if d < 0 {
                return Err(format!("--devices: negative ordinal {d}"));
            }
            if v.contains(&d) {
                return Err(format!("--devices: ordinal {d} given twice"));
            }
            v.push(d);
        }
        Ok(Devices::List(v))
    }

    /// The ordinals to use, given how many devices the driver reports.
    pub fn resolve(&self, count: i32) -> Result<Vec<i32>, String> {
        match self {
            Devices::All if count == 0 => Err("no CUDA device".into()),
            Devices::All => Ok((0..count).collect()),
            Devices::List(v) => match v.iter().find(|&&d| d >= count) {
                Some(d) => Err(format!(
                    "--devices: device {d} does not exist ({count} visible)"
                )),
                None => Ok(v.clone()),
            },
        }
    }
}

/// Splits `args` into (flag, value) pairs; `boolean` flags take no value, `valued` flags one.
pub fn pairs(
    args: &[String],
    boolean: &[&str],
    valued: &[&str],
) -> Result<Vec<(String, Option<String>)>, String> {
    let mut out = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if !a.starts_with("--") {
            return Err(format!("unexpected argument {a:?}"));
        }
        let name = a.split_once('=').map_or(a.as_str(), |(f, _)| f);
        if !boolean.contains(&name) && !valued.contains(&name) {
            return Err(format!("unknown flag {name}"));
        }
        if let Some((f, v)) = a.split_once('=') {
            out.push((f.to_string(), Some(v.to_string())));
        } else if boolean.contains(&a.as_str()) {
            out.push((a.clone(), None));
        } else {
            match it.next() {
                Some(v) => out.push((a.clone(), Some(v.clone()))),
                None => return Err(format!("{a} needs a value")),
            }
        }
    }
    Ok(out)
}

/// The value of a flag that takes one.
pub fn value<'a>(flag: &str, v: &'a Option<String>) -> Result<&'a str, String> {
    v.as_deref()
        .ok_or_else(|| format!("{flag} takes no value here"))
}

pub fn number<T: std::str::FromStr>(flag: &str, v: &Option<String>) -> Result<T, String> {
    let s = value(flag, v)?;
    let s2 = s.replace('_', "");
    if let Some((base, shift)) = s2.split_once("<<") {
        // Allows `1<<20`.
        let b: u64 = base.trim().parse().map_err(|_| bad(flag, s))?;
        let sh: u32 = shift.trim().parse().map_err(|_| bad(flag, s))?;
        let n = b
            .checked_shl(sh)
            .filter(|n| n >> sh == b)
            .ok_or_else(|| bad(flag, s))?;
        return n.to_string().parse().map_err(|_| bad(flag, s));
    }
    s2.parse().map_err(|_| bad(flag, s))
}

fn bad(flag: &str, s: &str) -> String {
    format!("{flag}: bad number {s:?}")
}

/// Options of `gpu-train`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainOpts {
    pub devices: Devices,
    pub elements: usize,
    pub interval_ms: u64,
    pub steps: Option<u64>,
    pub seed: u64,
}

pub const TRAIN_USAGE: &str =
    "usage: gpu-train [--devices all|0,1] [--elements N] [--interval-ms MS] [--steps N] [--seed S]";

impl TrainOpts {
    pub fn parse(args: &[String]) -> Result<TrainOpts, String> {
        let mut o = TrainOpts {
            devices: Devices::List(vec![0]),
            elements: 1 << 20,
            interval_ms: 100,
            steps: None,
            seed: 1,
        };
        let valued = [
            "--devices",
            "--elements",
            "--interval-ms",
            "--steps",
            "--seed",
        ];
        for (f, v) in pairs(args, &[], &valued)? {
            match f.as_str() {
                "--devices" => o.devices = Devices::parse(value(&f, &v)?)?,
                "--elements" => o.elements = number(&f, &v)?,
                "--interval-ms" => o.interval_ms = number(&f, &v)?,
                "--steps" => o.steps = Some(number(&f, &v)?),
                "--seed" => o.seed = number(&f, &v)?,
                _ => return Err(format!("unknown flag {f}")),
            }
        }
        if o.elements == 0 {
            return Err("--elements must be at least 1".into());
        }
        Ok(o)
    }
}

/// Options of `gpu-fill`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FillOpts {
    pub devices: Devices,
    /// Bytes per device.
    pub bytes: u64,
    pub seed: u64,
    pub verify_and_exit: bool,
    pub show_uuids: bool,
    /// With each `--show-uuids` report, every device ordinal the process sees.
    pub show_ordinals: bool,
    /// After filling, a `tick <n>` line every this many milliseconds, each after one driver call.
    pub tick_ms: Option<u64>,
}

pub const FILL_USAGE: &str = "usage: gpu-fill [--gib N | --mib M] [--devices all|0,1] [--seed S] [--verify-and-exit] [--show-uuids] [--show-ordinals] [--tick-ms MS]";

impl FillOpts {
    pub fn parse(args: &[String]) -> Result<FillOpts, String> {
        let mut o = FillOpts {
            devices: Devices::All,
            bytes: 1 << 30,
            seed: 1,
            verify_and_exit: false,
            show_uuids: false,
            show_ordinals: false,
            tick_ms: None,
        };
        let boolean = ["--verify-and-exit", "--show-uuids", "--show-ordinals"];
        let valued = ["--devices", "--gib", "--mib", "--seed", "--tick-ms"];
        for (f, v) in pairs(args, &boolean, &valued)? {
            match f.as_str() {
                "--devices" => o.devices = Devices::parse(value(&f, &v)?)?,
                "--gib" => o.bytes = mul(&f, number(&f, &v)?, 1 << 30)?,
                "--mib" => o.bytes = mul(&f, number(&f, &v)?, 1 << 20)?,
                "--seed" => o.seed = number(&f, &v)?,
                "--verify-and-exit" => o.verify_and_exit = true,
                "--show-uuids" => o.show_uuids = true,
                "--show-ordinals" => o.show_ordinals = true,
                "--tick-ms" => o.tick_ms = Some(number(&f, &v)?),
                _ => return Err(format!("unknown flag {f}")),
            }
        }
        if o.bytes == 0 {
            return Err("--gib/--mib must be at least 1".into());
        }
        if o.tick_ms == Some(0) {
            return Err("--tick-ms must be at least 1".into());
        }
        Ok(o)
    }
}

/// Options of `nccl-train` (the same as `c/nccl_allreduce.c`'s).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclOpts {
    /// `--ranks N`: this process launches N ranks (rank = `rank` + i, on GPU `device` + i).
    pub ranks: Option<u32>,
    /// The (first) rank: `--rank`, else `$RANK`, else 0.
    pub rank: u32,
    /// `--world-size`, else `$WORLD_SIZE`, else the number of ranks here.
    pub world: u32,
    /// The GPU of a single rank: `--device`, else `$LOCAL_RANK`, else 0; with `ranks`, the first
    /// rank's (`--device`, else 0).
    pub device: i32,
    /// `--rendezvous DIR` (else `$NCCL_RENDEZVOUS_DIR`): where rank 0 leaves the unique id.
    pub rendezvous: Option<String>,
    pub elements: usize,
    pub interval_ms: u64,
    pub steps: Option<u64>,
    pub seed: u64,
    /// `--corrupt RANK:STEP:ELEMENT`: flip bit 0 of that element of the reduced gradient.
    pub corrupt: Option<(u32, u64, usize)>,
}

pub const NCCL_USAGE: &str = "usage: nccl-train [--ranks N] [--rank R] [--world-size W] [--device D] [--rendezvous DIR] [--elements N] [--interval-ms MS] [--steps N] [--seed S] [--corrupt RANK:STEP:ELEMENT]";

impl NcclOpts {
    /// Parses `args`; `env` gives `RANK`, `WORLD_SIZE`, `LOCAL_RANK` and `NCCL_RENDEZVOUS_DIR`.
    pub fn parse(
        args: &[String],
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<NcclOpts, String> {
        let valued = [
            "--ranks",
            "--rank",
            "--world-size",
            "--device",
            "--rendezvous",
            "--elements",
            "--interval-ms",
            "--steps",
            "--seed",
            "--corrupt",
        ];
        let given = pairs(args, &[], &valued)?;
        let get = |flag: &str, var: &str| -> Option<Option<String>> {
            match given.iter().rev().find(|(f, _)| f == flag) {
                Some((_, v)) => Some(v.clone()),
                None => env(var).filter(|v| !v.is_empty()).map(Some),
            }
        };
        let num = |flag: &str, var: &str| -> Result<Option<u64>, String> {
            get(flag, var).map(|v| number(flag, &v)).transpose()
        };
        let ranks = num("--ranks", "")?.map(|n| n as u32);
        let rank = num("--rank", "RANK")?.unwrap_or(0) as u32;
        let here = ranks.unwrap_or(1);
        let world = num("--world-size", "WORLD_SIZE")?.map_or(here, |w| w as u32);
        let o = NcclOpts {
            ranks,
            rank,
            world,
            device: num("--device", if ranks.is_some() { "" } else { "LOCAL_RANK" })?.unwrap_or(0)
                as i32,
            rendezvous: get("--rendezvous", "NCCL_RENDEZVOUS_DIR").flatten(),
            elements: num("--elements", "")?.unwrap_or(1 << 20) as usize,
            interval_ms: num("--interval-ms", "")?.unwrap_or(100),
            steps: num("--steps", "")?,
            seed: num("--seed", "")?.unwrap_or(1),
            corrupt: get("--corrupt", "").map(|v| corrupt(&v)).transpose()?,
        };
        if ranks == Some(0) || world == 0 || o.elements == 0 {
            return Err("--ranks, --world-size and --elements must be at least 1".into());
        }
        if u64::from(rank) + u64::from(here) > u64::from(world) {
            return Err(format!(
                "ranks {rank}..{} do not fit in a world of {world}",
                rank + here - 1
            ));
        }
        if world > here && o.rendezvous.is_none() {
            return Err(format!(
                "a world of {world} with {here} rank(s) here needs --rendezvous DIR"
            ));
        }
        if let Some((r, _, i)) = o.corrupt {
            if r >= world || i >= o.elements {
                return Err("--corrupt: rank or element out of range".into());
            }
        }
        Ok(o)
    }
}

fn corrupt(v: &Option<String>) -> Result<(u32, u64, usize), String> {
    let s = value("--corrupt", v)?;
    let bad = || format!("--corrupt: want RANK:STEP:ELEMENT, got {s:?}");
    let mut it = s.split(':').map(|p| p.parse::<u64>().map_err(|_| bad()));
    match (it.next(), it.next(), it.next(), it.next()) {
        (Some(r), Some(k), Some(i), None) => Ok((r? as u32, k?, i? as usize)),
        _ => Err(bad()),
    }
}

fn mul(flag: &str, n: u64, unit: u64) -> Result<u64, String> {
    n.checked_mul(unit)
        .ok_or_else(|| format!("{flag}: {n} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn devices() {
        assert_eq!(Devices::parse("all"), Ok(Devices::All));
        assert_eq!(Devices::parse("0,1"), Ok(Devices::List(vec![0, 1])));
        assert!(Devices::parse("0,0").is_err());
        assert!(Devices::parse("x").is_err());
        assert!(Devices::parse("-1").is_err());
        assert_eq!(Devices::All.resolve(2), Ok(vec![0, 1]));
        assert!(Devices::All.resolve(0).is_err());
        assert!(Devices::List(vec![2]).resolve(2).is_err());
    }

    #[test]
    fn train_defaults_and_flags() {
        let d = TrainOpts::parse(&[]).unwrap();
        assert_eq!(d.devices, Devices::List(vec![0]));
        assert_eq!((d.elements, d.interval_ms, d.steps), (1 << 20, 100, None));
        let o = TrainOpts::parse(&s(&[
            "--devices=all",
            "--elements",
            "1<<10",
            "--interval-ms",
            "0",
            "--steps",
            "5",
            "--seed",
            "42",
        ]))
        .unwrap();
        assert_eq!(o.devices, Devices::All);
        assert_eq!(
            (o.elements, o.interval_ms, o.steps, o.seed),
            (1024, 0, Some(5), 42)
        );
        assert!(TrainOpts::parse(&s(&["--elements", "0"])).is_err());
        assert!(TrainOpts::parse(&s(&["--steps"])).is_err());
        assert!(TrainOpts::parse(&s(&["--bogus", "1"])).is_err());
        assert!(TrainOpts::parse(&s(&["stray"])).is_err());
    }

    #[test]
    fn fill_sizes_and_flags() {
        let d = FillOpts::parse(&[]).unwrap();
        assert_eq!((d.devices, d.bytes), (Devices::All, 1 << 30));
        let o =
            FillOpts::parse(&s(&["--mib", "3", "--verify-and-exit", "--devices", "1"])).unwrap();
        assert_eq!(o.bytes, 3 << 20);
        assert!(o.verify_and_exit);
        assert_eq!(o.devices, Devices::List(vec![1]));
        assert_eq!(FillOpts::parse(&s(&["--gib=4"])).unwrap().bytes, 4 << 30);
        assert!(FillOpts::parse(&s(&["--gib", "99999999999999"])).is_err());
        assert!(FillOpts::parse(&s(&["--mib", "0"])).is_err());
        assert_eq!(d.tick_ms, None);
        assert_eq!(
            FillOpts::parse(&s(&["--tick-ms", "10"])).unwrap().tick_ms,
            Some(10)
        );
        assert!(FillOpts::parse(&s(&["--tick-ms", "0"])).is_err());
    }

    #[test]
    fn nccl_ranks_world_and_rendezvous() {
        let none = |_: &str| None;
        let d = NcclOpts::parse(&[], none).unwrap();
        assert_eq!((d.ranks, d.rank, d.world, d.device), (None, 0, 1, 0));
        let o = NcclOpts::parse(&s(&["--ranks", "4", "--elements", "64"]), none).unwrap();
        assert_eq!((o.ranks, o.world, o.elements), (Some(4), 4, 64));
        let env = |v: &str| match v {
            "RANK" => Some("3".to_string()),
            "WORLD_SIZE" => Some("4".to_string()),
            "LOCAL_RANK" => Some("1".to_string()),
            "NCCL_RENDEZVOUS_DIR" => Some("/shared".to_string()),
            _ => None,
        };
        let o = NcclOpts::parse(&[], env).unwrap();
        assert_eq!((o.rank, o.world, o.device), (3, 4, 1));
        assert_eq!(o.rendezvous.as_deref(), Some("/shared"));
        assert_eq!(NcclOpts::parse(&s(&["--rank", "2"]), env).unwrap().rank, 2);
        // A world larger than this process needs the directory.
        assert!(NcclOpts::parse(&s(&["--world-size", "2"]), none).is_err());
        assert!(NcclOpts::parse(
            &s(&["--rank", "4", "--world-size", "4", "--rendezvous", "/d"]),
            none
        )
        .is_err());
        let c = NcclOpts::parse(
            &s(&["--ranks", "2", "--corrupt", "1:3:7", "--elements", "8"]),
            none,
        )
        .unwrap();
        assert_eq!(c.corrupt, Some((1, 3, 7)));
        assert!(NcclOpts::parse(&s(&["--ranks", "2", "--corrupt", "2:3:7"]), none).is_err());
        assert!(NcclOpts::parse(&s(&["--corrupt", "1:3"]), none).is_err());
        assert!(NcclOpts::parse(&s(&["--ranks", "0"]), none).is_err());
    }

    #[test]
    fn numbers() {
        assert_eq!(number::<u64>("--n", &Some("1_000".into())), Ok(1000));
        assert_eq!(number::<u64>("--n", &Some("1<<20".into())), Ok(1 << 20));
        assert!(number::<u32>("--n", &Some("1<<40".into())).is_err());
        assert!(number::<u64>("--n", &Some("1<<64".into())).is_err());
        assert!(number::<u64>("--n", &None).is_err());
    }
}
