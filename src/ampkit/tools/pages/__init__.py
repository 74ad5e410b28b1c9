"""What the HTML reports share (the demo's and compare's): the output folder and page
rendering (:mod:`ampkit.tools.pages.html`, with the jinja2 templates in ``templates/``)
and the bare-matplotlib figure helpers (:mod:`ampkit.tools.pages.plotting`)."""
