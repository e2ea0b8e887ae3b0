// Command imagepack writes a root file system as a single-layer image in
// docker-archive format (what `docker save` writes and `ctr images import`
// reads), with no container engine: a reproducible tar (sorted entries,
// zero times, root ownership), its digest, an image config and a manifest.
package main

import (
	"archive/tar"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

func main() {
	rootfs := flag.String("rootfs", "", "directory to pack")
	tag := flag.String("tag", "", "repository:tag of the image; a comma-separated list gives it several")
	out := flag.String("out", "", "output tar")
	entrypoint := flag.String("entrypoint", "", "the image's entry point")
	flag.Parse()
	if *rootfs == "" || *tag == "" || *out == "" || *entrypoint == "" {
		fmt.Fprintln(os.Stderr, "usage: imagepack -rootfs DIR -tag REPO:TAG -entrypoint CMD -out FILE")
		os.Exit(2)
	}
	if err := pack(*rootfs, *tag, *entrypoint, *out); err != nil {
		fmt.Fprintln(os.Stderr, "imagepack:", err)
		os.Exit(1)
	}
}

func pack(rootfs, tag, entrypoint, out string) error {
	layer, err := os.CreateTemp(filepath.Dir(out), ".layer-*.tar")
	if err != nil {
		return err
	}
	defer os.Remove(layer.Name())
	h := sha256.New()
	if err := writeLayer(rootfs, io.MultiWriter(layer, h)); err != nil {
		return err
	}
	if err := layer.Close(); err != nil {
		return err
	}
	diffID := "sha256:" + hex.EncodeToString(h.Sum(nil))
	config, err := json.Marshal(map[string]any{
		"architecture": "amd64",
		"os":           "linux",
		"created":      time.Unix(0, 0).UTC(),
		"config": map[string]any{
			"Entrypoint": []string{entrypoint},
			"Env":        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
			"WorkingDir": "/",
		},
		"rootfs":  map[string]any{"type": "layers", "diff_ids": []string{diffID}},
		"history": []map[string]any{{"created": time.Unix(0, 0).UTC(), "created_by": "hack/build-image.sh"}},
	})
	if err != nil {
		return err
	}
	cfgSum := sha256.Sum256(config)
	cfgName := hex.EncodeToString(cfgSum[:]) + ".json"
	layerName := diffID[len("sha256:"):] + "/layer.tar"
	manifest, err := json.Marshal([]map[string]any{{"Config": cfgName, "RepoTags": strings.Split(tag, ","), "Layers": []string{layerName}}})
	if err != nil {
		return err
	}
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(f)
	add := func(name string, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(data)), ModTime: time.Unix(0, 0)}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	if err := add(cfgName, config); err != nil {
		return err
	}
	lf, err := os.Open(layer.Name())
	if err != nil {
		return err
	}
	defer lf.Close()
	st, err := lf.Stat()
	if err != nil {
		return err
	}
	if err := tw.WriteHeader(&tar.Header{Name: layerName, Mode: 0o644, Size: st.Size(), ModTime: time.Unix(0, 0)}); err != nil {
		return err
	}
	if _, err := io.Copy(tw, lf); err != nil {
		return err
	}
	if err := add("manifest.json", manifest); err != nil {
		return err
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return f.Close()
}

func writeLayer(root string, w io.Writer) error {
	var paths []string
	if err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p != root {
			paths = append(paths, p)
		}
		return nil
	}); err != nil {
		return err
	}
	sort.Strings(paths)
	tw := tar.NewWriter(w)
	for _, p := range paths {
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		link := ""
		if fi.Mode()&os.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		hdr.Name = filepath.ToSlash(rel)
		if fi.IsDir() {
			hdr.Name += "/"
		}
		hdr.ModTime, hdr.AccessTime, hdr.ChangeTime = time.Unix(0, 0), time.Time{}, time.Time{}
		hdr.Uid, hdr.Gid, hdr.Uname, hdr.Gname = 0, 0, "", ""
		hdr.Format = tar.FormatPAX
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			_, err = io.Copy(tw, f)
			f.Close()
			if err != nil {
				return err
			}
		}
	}
	return tw.Close()
}
