// Builds the UI into the Python package (src/aiprof/server/static), which is not committed:
// `make setup` runs `npm ci && npm run build`. Fixed file names (one JS, one CSS) let
// `aiprof analyze --html` inline them into a self-contained report.
import { defineConfig } from 'vite';

export default defineConfig({
  base: './',
  build: {
    outDir: '../src/aiprof/server/static',
    emptyOutDir: true,
    chunkSizeWarningLimit: 4000,
    cssCodeSplit: false,
    modulePreload: false,
    rollupOptions: {
      output: {
        entryFileNames: 'assets/app.js',
        chunkFileNames: 'assets/[name].js',
        assetFileNames: 'assets/[name][extname]',
      },
    },
  },
});
