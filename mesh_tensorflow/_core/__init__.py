"""Pure-Python core: names, shapes, layouts, the lazy graph. No devices here."""
