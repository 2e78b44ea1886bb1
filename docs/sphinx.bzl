"""A Sphinx site as a directory artifact, built by a py_binary."""

def _sphinx_site_impl(ctx):
    out = ctx.actions.declare_directory(ctx.label.name)
    ctx.actions.run(
        executable = ctx.attr.builder[DefaultInfo].files_to_run,
        arguments = [out.path],
        outputs = [out],
        mnemonic = "SphinxSite",
        progress_message = "Building the documentation site " + out.short_path,
        use_default_shell_env = True,
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

sphinx_site = rule(
    implementation = _sphinx_site_impl,
    doc = "Runs `builder OUT_DIR`, which writes the HTML site into OUT_DIR.",
    attrs = {
        # Built for the target configuration, like the tests, so the native
        # extension the API pages import is the one the tests already built.
        "builder": attr.label(executable = True, cfg = "target", mandatory = True),
    },
)
