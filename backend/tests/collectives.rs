//! burn-collective's all-gather and reduce-scatter (rcoa's patch) between
//! processes: this test binary runs burn-collective's orchestrator in a
//! thread and starts itself twice as the two ranks (`rank_process`, which
//! does nothing unless `RCOA_COLLECTIVE_RANK` is set). Each rank
//! reduce-scatters a vector, all-gathers a shard (in fp32, then in f64) and
//! all-reduces an odd-length vector, and prints what it got; the
//! parent checks the mean, the order and the shard indices. Two threads of
//! one process are tested in `distributed.rs`.

use burn::tensor::{FloatDType, Tensor};
use rcoa_backend::distributed::Collective;
use rcoa_backend::testing::{free_port, loopback_node};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

type I = burn::backend::NdArray<f32>;

/// One rank, when started by `two_processes_gather_and_scatter`.
#[test]
fn rank_process() {
    let Ok(rank) = std::env::var("RCOA_COLLECTIVE_RANK") else {
        return;
    };
    let rank: u32 = rank.parse().unwrap();
    let orchestrator = std::env::var("RCOA_COLLECTIVE_ORCHESTRATOR").unwrap();
    let d = loopback_node(2, rank, orchestrator, Duration::from_secs(30));
    let device = Default::default();
    let c = Collective::<I>::register(&d, &device).unwrap();
    c.progress().set_step(1);
    let index = c.shard_index().unwrap();
    let x = rank as f32;
    // Six values: three per rank after the reduce-scatter.
    let t = Tensor::<I, 1>::from_floats([x, 1.0, 2.0 * x, 10.0, 20.0 + x, 30.0], &device);
    let (shard, at) = c.reduce_scatter_mean(t).unwrap();
    let mine = Tensor::<I, 1>::from_floats([index as f32, 100.0 + index as f32], &device);
    let all = c.all_gather(mine).unwrap();
    // The same in f64 (the ring adds on the host by dtype; NdArray has no
    // 16-bit floats), and an all-reduce of an odd length.
    let f64s =
        |v: Vec<f32>| Tensor::<I, 1>::from_floats(v.as_slice(), &device).cast(FloatDType::F64);
    let (wide_shard, _) = c
        .reduce_scatter_mean(f64s(vec![x, 1.0, 2.0 * x, 10.0, 20.0 + x, 30.0]))
        .unwrap();
    let wide_all = c.all_gather(f64s(vec![index as f32, 0.5])).unwrap();
    let odd = c
        .mean(Tensor::<I, 1>::from_floats(
            [x, 3.0, 2.0 * x, 5.0, 7.0],
            &device,
        ))
        .unwrap();
    let f32s = |t: Tensor<I, 1>| t.cast(FloatDType::F32).into_data().to_vec::<f32>().unwrap();
    c.progress().set_done();
    println!(
        "RESULT {index} {at} {:?} {:?} {:?} {:?} {:?}",
        shard.into_data().to_vec::<f32>().unwrap(),
        all.into_data().to_vec::<f32>().unwrap(),
        f32s(wide_shard),
        f32s(wide_all),
        f32s(odd)
    );
}

#[test]
fn two_processes_gather_and_scatter() {
    if std::env::var("RCOA_COLLECTIVE_RANK").is_ok() {
        return;
    }
    let port = free_port();
    std::thread::spawn(move || {
        rcoa_backend::distributed::orchestrate(port, Duration::from_secs(90)).unwrap()
    });
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(start.elapsed() < Duration::from_secs(20), "no orchestrator");
        std::thread::sleep(Duration::from_millis(50));
    }
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(&exe)
                .args(["rank_process", "--exact", "--nocapture", "--test-threads=1"])
                .env("RCOA_COLLECTIVE_RANK", rank.to_string())
                .env("RCOA_COLLECTIVE_ORCHESTRATOR", format!("127.0.0.1:{port}"))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // A hang fails the test instead of blocking it.
    let deadline = Instant::now() + Duration::from_secs(60);
    while children.iter_mut().any(|c| c.try_wait().unwrap().is_none()) {
        if Instant::now() > deadline {
            for c in &mut children {
                let _ = c.kill();
            }
            panic!("the ranks did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut seen = Vec::new();
    for c in children {
        let out = c.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line = stdout
            .lines()
            .find_map(|l| l.strip_prefix("RESULT "))
            .unwrap_or_else(|| panic!("no result: {stdout}"))
            .to_string();
        seen.push(line);
    }
    // The mean of [0, 1, 0, 10, 20, 30] and [1, 1, 2, 10, 21, 30], in
    // shard-index order; the all-gather of [i, 100 + i] in the same order.
    let shards = ["[0.5, 1.0, 1.0]", "[10.0, 20.5, 30.0]"];
    let all = "[0.0, 100.0, 1.0, 101.0]";
    let mut indices = Vec::new();
    for line in &seen {
        let index: usize = line.split(' ').next().unwrap().parse().unwrap();
        assert_eq!(
            line,
            &format!(
                "{index} {index} {} {all} {} [0.0, 0.5, 1.0, 0.5] [0.5, 3.0, 1.0, 5.0, 7.0]",
                shards[index], shards[index]
            ),
            "{seen:?}"
        );
        indices.push(index);
    }
    indices.sort();
    assert_eq!(indices, vec![0, 1], "{seen:?}");
}
