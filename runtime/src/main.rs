fn main() -> std::process::ExitCode {
    khata::cli::main()
}
